"""ruff keeps the code lint-clean and formatted (the project's one style)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
