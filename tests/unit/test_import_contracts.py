"""import-linter keeps the dependency direction: components import the core, never each other.

import-linter walks a package's folder, and in this repository the components
live in their own folders mapped to subpackages (pyproject's package-dir), so
the test lays out the installed shape of the package in a temporary folder
(as a wheel would) and runs `lint-imports` on it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"kubellm": "kubellm", "operator": "kubellm/operator", "gateway": "kubellm/gateway",
           "autoscaler": "kubellm/autoscaler", "engine_image": "kubellm/engine"}  # fmt: skip


def _installed_shape(target: Path) -> None:
    for folder, package in FOLDERS.items():
        shutil.copytree(
            ROOT / folder, target / package, dirs_exist_ok=True,
            ignore=lambda _d, names: [n for n in names if not (n.endswith(".py") or
                                      (Path(_d, n).is_dir() and n != "__pycache__"))],
        )  # fmt: skip


def _lint(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
         "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path, check=False,
    )  # fmt: skip


def test_import_contracts_hold(tmp_path: Path) -> None:
    _installed_shape(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("kubellm/gateway/_probe.py", "import kubellm.operator\n"),
        ("kubellm/_probe.py", "import kubellm.autoscaler\n"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, where: str, line: str) -> None:
    _installed_shape(tmp_path)
    probe = tmp_path / where
    probe.write_text(line)
    if where == "kubellm/_probe.py":  # make the probe part of the core contract's sources
        api = tmp_path / "kubellm" / "api.py"
        api.write_text(api.read_text() + "\nfrom kubellm import _probe  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
