"""Every Python package folder is declared in pyproject, so a wheel (the images) carries it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_declared() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in parts:
                found.add(".".join([package, *parts]))
    missing = found - set(config["packages"])
    assert not missing, f"add these to [tool.setuptools] packages: {sorted(missing)}"
