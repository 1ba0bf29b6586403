"""Every benchmark script answers --help with what it measures, and runs nothing, run the
one way the scripts are run: `python -m bench.x` from the repository root."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Scripts: the files run as programs (bench/_fleet.py, a module they share, is none).
SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py") if "__main__" in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage_and_runs_nothing(script: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{script.stem}", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:")
    assert len(result.stdout.splitlines()) > 3  # a description, not only the usage line


def test_every_module_imports_as_part_of_the_bench_package() -> None:
    """bench/ is a package: each module imports as `bench.x` (its shared modules by their
    absolute names), and none puts a folder on sys.path to find the others."""
    paths = sorted((ROOT / "bench").rglob("*.py"))
    for path in paths:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        before = list(sys.path)
        importlib.import_module(name)
        assert sys.path == before, f"{name} changed sys.path"
