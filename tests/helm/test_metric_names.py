"""Every metric the alerts and the dashboard query is one the code exports.

Names come from three places:

- the core contract, `kubellm.metrics` (engine `vllm:*` names and the gateway's names);
- the components' own Prometheus registries, built in-process when the component exists:
  the gateway's `kubellm.gateway.routing.latency.metrics.create().registry` and the autoscaler's
  `kubellm.autoscaler.telemetry.Telemetry().registry` (add a line to `REGISTRIES` for a new one);
- Prometheus itself (`up`).

Recording rules (`kubellm:*`) must be defined by a `record:` in the rule file. `PENDING` lists
names the chart already uses that the core and the gateway are asked to add; once one is
exported, the test asks for it to be taken off the list.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from kubellm import metrics
from tests.helm.chart import DASHBOARD_SOURCE, RULES_SOURCE, objects, of_kind


def _tenancy_registry() -> Any:
    """The per-tenant series (`kubellm.gateway.routing.flow.controller.TenantMetrics`)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    importlib.import_module("kubellm.gateway.routing.flow.controller").TenantMetrics(registry)
    return registry


# Builders of each component's registry (no I/O: each builds a fresh CollectorRegistry).
REGISTRIES: dict[str, Callable[[], Any]] = {
    "gateway": lambda: (
        importlib.import_module("kubellm.gateway.routing.latency.metrics").create().registry
    ),
    "tenancy": _tenancy_registry,
    "autoscaler": lambda: (
        importlib.import_module("kubellm.autoscaler.telemetry").Telemetry().registry
    ),
}

# Asked of the lead (core kubellm/metrics.py + gateway): see docs/operations.md, "Metrics".
PENDING: set[str] = set()
PROMETHEUS_BUILTIN = {"up"}
# Histograms in the core contract (kubellm/metrics.py marks them in comments).
CORE_HISTOGRAMS = {
    metrics.TIME_TO_FIRST_TOKEN,
    metrics.INTER_TOKEN_LATENCY,
    metrics.GATEWAY_TTFT,
    metrics.GATEWAY_ITL,
    metrics.GATEWAY_E2E,
}
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")
NAME = re.compile(
    r"(?<![\w:\"-])(vllm:[a-z_:]+|kubellm_[a-z0-9_]+|kubellm:[a-z0-9_:]+|up)(?=[\s{\[),])"
)


def _samples(name: str, kind: str) -> set[str]:
    if kind == "counter":
        return {name if name.endswith("_total") else f"{name}_total"}
    if kind == "histogram":
        return {name + s for s in HISTOGRAM_SUFFIXES}
    return {name}


def core_names() -> set[str]:
    out: set[str] = set()
    for value in vars(metrics).values():
        if isinstance(value, str) and (value.startswith("vllm:") or value.startswith("kubellm_")):
            kind = (
                "histogram"
                if value in CORE_HISTOGRAMS
                else "counter"
                if value.endswith("_total")
                else "gauge"
            )
            out |= _samples(value, kind)
    return out


def registry_names() -> dict[str, set[str]]:
    out = {}
    for component, build in REGISTRIES.items():
        registry = build()  # a renamed module fails here, not silently
        out[component] = {
            sample for family in registry.collect() for sample in _samples(family.name, family.type)
        }
    return out


def exported_names() -> set[str]:
    names = core_names() | PROMETHEUS_BUILTIN
    for found in registry_names().values():
        names |= found
    return names


def rule_groups() -> list[dict[str, Any]]:
    (rule,) = of_kind(objects("full-values"), "PrometheusRule")
    return rule["spec"]["groups"]


def rule_exprs() -> list[str]:
    return [r["expr"] for g in rule_groups() for r in g["rules"]]


def recorded() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD_SOURCE.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def names_in(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in NAME.findall(e)}


def test_name_extraction_finds_metrics_not_labels() -> None:
    found = names_in(['sum by (le) (rate(kubellm_gateway_x_bucket{job="kubellm-engine"}[5m]))',
                      "up == 0", "vllm:num_requests_waiting{a=\"b\"}"])  # fmt: skip
    assert found == {"kubellm_gateway_x_bucket", "up", "vllm:num_requests_waiting"}


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_queried_metric_is_exported(source: str) -> None:
    used = names_in(rule_exprs() if source == "rules" else dashboard_exprs())
    assert used, "no metric names found: the extraction is broken"
    records = recorded()
    undefined = {n for n in used if n.startswith("kubellm:")} - records
    assert not undefined, f"recording rules used but not defined: {sorted(undefined)}"
    exported = exported_names()
    unknown = (
        {n for n in used if not n.startswith("kubellm:")}
        - exported
        - {p + s for p in PENDING for s in ("", *HISTOGRAM_SUFFIXES)}
    )
    assert not unknown, f"{source} query metrics nobody exports: {sorted(unknown)}"


def test_pending_names_are_still_pending() -> None:
    done = PENDING & exported_names()
    assert not done, f"now exported, take them off PENDING: {sorted(done)}"


def test_rules_and_dashboard_use_every_input_the_issue_names() -> None:
    used = names_in(rule_exprs()) | names_in(dashboard_exprs())
    for name in (
        metrics.GATEWAY_TTFT + "_bucket",
        metrics.GATEWAY_ITL + "_bucket",
        metrics.GATEWAY_GOODPUT,
        metrics.GATEWAY_REQUESTS,
        metrics.GATEWAY_FALLBACK,
        metrics.NUM_REQUESTS_WAITING,
        metrics.KV_CACHE_USAGE,
        metrics.PREFIX_CACHE_HITS,
        metrics.PREFIX_CACHE_QUERIES,
    ):
        assert name in used, name


def test_rule_file_in_the_chart_is_the_source() -> None:
    source = yaml.safe_load(RULES_SOURCE.read_text())
    assert rule_groups() == source["groups"]
