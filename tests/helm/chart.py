"""Render the kubellm chart with the real Helm library, for the chart tests.

`helm_python` (helm-python-sdk) carries Helm v4 as a shared library: rendering is the same
code path as `helm template`, offline. Results are cached per values file: the chart renders
in well under a second, but several test modules read the same output.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml
from helm_python.chart import Chart

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "helm" / "kubellm"
CI_VALUES = sorted((CHART_DIR / "ci").glob("*-values.yaml"))
RULES_SOURCE = CHART_DIR / "files" / "prometheus" / "kubellm-rules.yaml"
DASHBOARD_SOURCE = CHART_DIR / "files" / "dashboards" / "kubellm-slo.json"
RELEASE = "kubellm"
NAMESPACE = "kubellm-system"

# Value sets every chart test runs against: the defaults, then each ci/*-values.yaml.
VALUE_SETS: dict[str, Path | None] = {"default": None, **{p.stem: p for p in CI_VALUES}}


def values_of(name: str) -> dict[str, Any]:
    path = VALUE_SETS[name]
    return yaml.safe_load(path.read_text()) if path else {}


@functools.cache
def chart() -> Chart:
    return Chart.load(CHART_DIR)


@functools.cache
def _rendered(name: str) -> dict[str, str]:
    return chart().render(values_of(name), name=RELEASE, namespace=NAMESPACE)


def rendered_text(name: str) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included)."""
    return dict(_rendered(name))


def render_values(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Render with explicit values (uncached) and return the Kubernetes objects."""
    return _objects(chart().render(values, name=RELEASE, namespace=NAMESPACE))


def objects(name: str) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders with the named value set."""
    return _objects(_rendered(name))


def _objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        out.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return out


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def component(obj: dict[str, Any]) -> str | None:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")
