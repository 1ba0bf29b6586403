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
import tomllib
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
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert f"Contracts: {len(contracts['contracts'])} kept, 0 broken" in result.stdout


COMPONENTS = "Components are independent of each other"
CORE = "The core imports no component"
NO_TOOLS = "Components import neither the tools nor the composition root"
TOOLS = "The tools are independent of each other"


@pytest.mark.parametrize(
    ("where", "line", "contract"),
    [
        ("kubellm/gateway/_probe.py", "import kubellm.operator\n", COMPONENTS),
        ("kubellm/_probe.py", "import kubellm.autoscaler\n", CORE),
        ("kubellm/contracts.py", "import kubellm.gateway\n", CORE),
        # the tools and the local fleet
        ("kubellm/gateway/_probe.py", "import kubellm.bench.runner\n", NO_TOOLS),
        ("kubellm/engine/_probe.py", "import kubellm.fleet.runtime\n", NO_TOOLS),
        ("kubellm/autoscaler/_probe.py", "import kubellm.diagnose\n", NO_TOOLS),
        ("kubellm/bench/_probe.py", "import kubellm.gateway\n", CORE),
        ("kubellm/diagnose/_probe.py", "import kubellm.engine.sim\n", CORE),
        ("kubellm/diagnose/_probe.py", "import kubellm.bench.stats\n", TOOLS),
        ("kubellm/bench/_probe.py", "import kubellm.fleet.main\n", CORE),  # fleet wiring
        ("kubellm/fleet/status.py", "import kubellm.gateway\n", CORE),
        ("kubellm/fleet/processes.py", "import kubellm.autoscaler\n", CORE),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tmp_path: Path, where: str, line: str, contract: str
) -> None:
    _installed_shape(tmp_path)
    probe = tmp_path / where
    probe.write_text((probe.read_text() if probe.exists() else "") + line)
    if where == "kubellm/_probe.py":  # make the probe part of the core contract's sources
        api = tmp_path / "kubellm" / "api.py"
        api.write_text(api.read_text() + "\nfrom kubellm import _probe  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert f"{contract} BROKEN" in " ".join(result.stdout.split()), result.stdout


def test_the_fleets_wiring_may_import_components(tmp_path: Path) -> None:
    """The composition root (kubellm up) starts components: not a broken contract."""
    _installed_shape(tmp_path)
    runtime = tmp_path / "kubellm" / "fleet" / "runtime.py"
    runtime.write_text(runtime.read_text() + "import kubellm.engine.sim\n")
    assert _lint(tmp_path).returncode == 0
