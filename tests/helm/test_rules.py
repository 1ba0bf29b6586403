"""The rendered PrometheusRule: `promtool check rules`, and `promtool test rules` scenarios.

Each scenario feeds synthetic series (what the gateway, the engines and the autoscaler would
export) and states, at given times, which alerts fire. Every burn-rate alert is shown firing
when its burn rate and both its windows say so, and silent otherwise: a burn just under its
factor, a short spike the long window absorbs, a recovery the short window notices, a looser
per-deployment objective. promtool compares labels and annotations; the expected annotations
are the rule's own, with `{{ $labels.x }}` filled in, so only labels are spelt out here.

promtool comes from Debian's `prometheus` package (`apt-get install --no-install-recommends
prometheus`); without it these tests are skipped with that message.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import ROOT, objects, of_kind

PROMTOOL = shutil.which("promtool")
# Skipped on a laptop without promtool; CI (CI=true) installs it and never skips.
pytestmark = pytest.mark.skipif(
    PROMTOOL is None and not os.environ.get("CI"),
    reason="promtool missing: apt-get install -y --no-install-recommends prometheus",
)

NS = "team-a"
KINDS = {
    "ttft": ("kubellm_gateway_time_to_first_token_seconds", "TTFT"),
    "itl": ("kubellm_gateway_inter_token_latency_seconds", "ITL"),
}
BURNS = {
    "Fast": ("1h", "5m", "page"),
    "Medium": ("6h", "30m", "page"),
    "Slow": ("3d", "6h", "ticket"),
}
RATE = 100  # requests (or token gaps) per minute


@pytest.fixture(scope="module")
def rule_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    (rule,) = of_kind(objects("full-values"), "PrometheusRule")
    path = tmp_path_factory.mktemp("rules") / "kubellm-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def rules(rule_file: Path) -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(rule_file.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_promtool_check_rules(rule_file: Path) -> None:
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(rule_file)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# --------------------------------------------------------------------------- synthetic series


def cumulative(per_minute: list[float]) -> str:
    """A counter's values, one a minute, from its increase in each minute."""
    total, values = 0.0, [0.0]
    for step in per_minute:
        total += step
        values.append(total)
    return " ".join(f"{v:g}" for v in values)


def latency(
    kind: str,
    deployment: str,
    phases: list[tuple[int, float]],
    *,
    target_le: str,
    objective: float = 0.99,
) -> list[dict[str, str]]:
    """A gateway histogram with RATE observations a minute, `bad` of them over the target.

    phases: (minutes, share over the target). Half the good ones also fall in a lower bucket,
    so only the bucket at the target gives the right answer.
    """
    metric = KINDS[kind][0]
    good: list[float] = []
    for minutes, bad in phases:
        good += [RATE * (1 - bad)] * minutes
    total = [float(RATE)] * len(good)
    labels = f'namespace="{NS}", deployment="{deployment}", model="{deployment}"'
    n = len(good)
    target = f'kubellm_gateway_slo_target_seconds{{{labels}, kind="{kind}", le="{target_le}"}}'
    return [
        {"series": f'{metric}_bucket{{{labels}, le="0.001"}}', "values": cumulative(
            [g / 2 for g in good]
        )},
        {"series": f'{metric}_bucket{{{labels}, le="{target_le}"}}', "values": cumulative(good)},
        {"series": f'{metric}_bucket{{{labels}, le="+Inf"}}', "values": cumulative(total)},
        {"series": f"{metric}_count{{{labels}}}", "values": cumulative(total)},
        {"series": target, "values": f"{float(target_le):g}+0x{n}"},
        {"series": f"kubellm_gateway_slo_objective{{{labels}}}", "values": f"{objective:g}+0x{n}"},
    ]  # fmt: skip


def gauge(name: str, labels: str, value: float, minutes: int) -> dict[str, str]:
    return {"series": f"{name}{{{labels}}}", "values": f"{value:g}+0x{minutes}"}


def counter(name: str, labels: str, per_minute: float, minutes: int) -> dict[str, str]:
    return {"series": f"{name}{{{labels}}}", "values": f"0+{per_minute:g}x{minutes}"}


@dataclass
class Scenario:
    series: list[dict[str, str]]
    # eval time -> alert name -> the firing alerts' labels (beyond the rule's own); [] = silent
    expect: dict[str, dict[str, list[dict[str, str]]]] = field(default_factory=dict)


def burn_expectations(
    deployment: str, firing: dict[str, set[str]], kinds: tuple[str, ...] = ("ttft", "itl")
) -> dict[str, list[dict[str, str]]]:
    """All six burn alerts: those in `firing` ({kind: {"Fast", ...}}) fire, the rest are silent."""
    out = {}
    for kind in kinds:
        for speed in BURNS:
            name = f"Kubellm{KINDS[kind][1]}ErrorBudgetBurn{speed}"
            on = speed in firing.get(kind, set())
            out[name] = [{"namespace": NS, "deployment": deployment}] if on else []
    return out


D = 'namespace="team-a", deployment="chat"'
SCENARIOS: dict[str, Scenario] = {
    # 20% over target = 20x the 1% budget: the 1h/5m page fires after its 2m `for`; the 6h/30m
    # page needs 15m and the ticket 1h, so they are still pending at 10m.
    "fast-burn-pages": Scenario(
        latency("ttft", "chat", [(20, 0.20)], target_le="2.0"),
        {"10m": burn_expectations("chat", {"ttft": {"Fast"}})},
    ),
    # 8%: over 6x (0.06), under 14.4x (0.144): the 6h/30m page only.
    "medium-burn-pages": Scenario(
        latency("ttft", "chat", [(60, 0.08)], target_le="2.0"),
        {"50m": burn_expectations("chat", {"ttft": {"Medium"}})},
    ),
    # 2%: over 1x, under 6x: a ticket only, after its 1h `for`.
    "slow-burn-tickets": Scenario(
        latency("ttft", "chat", [(150, 0.02)], target_le="2.0"),
        {
            "50m": burn_expectations("chat", {}),
            "140m": burn_expectations("chat", {"ttft": {"Slow"}}),
        },
    ),
    # 0.5%: within budget, nothing fires.
    "within-budget-is-silent": Scenario(
        latency("ttft", "chat", [(240, 0.005)], target_le="2.0"),
        {t: burn_expectations("chat", {}) for t in ("30m", "90m", "230m")},
    ),
    # A 5-minute total outage after an hour of good service: the 5m window is at 100% but the
    # 1h window stays under 14.4x, so the fast page does not fire.
    "short-spike-does-not-page": Scenario(
        latency("ttft", "chat", [(60, 0.005), (5, 1.0), (10, 0.005)], target_le="2.0"),
        {t: {"KubellmTTFTErrorBudgetBurnFast": []} for t in ("63m", "65m", "68m")},
    ),
    # 40% for 30 minutes, then clean: fires, then resolves 5 minutes later although the 1h
    # window is still far over 14.4x.
    "recovery-resolves-the-page": Scenario(
        latency("ttft", "chat", [(30, 0.40), (30, 0.0)], target_le="2.0"),
        {
            "20m": {"KubellmTTFTErrorBudgetBurnFast": [{"namespace": NS, "deployment": "chat"}]},
            "45m": {"KubellmTTFTErrorBudgetBurnFast": []},
        },
    ),
    # The objective is per deployment: at 0.9 the budget is 10%, so 20% over target is a 2x
    # burn: a ticket, not a page. Same traffic at 0.99 pages (fast-burn-pages).
    "objective-is-per-deployment": Scenario(
        latency("ttft", "chat", [(150, 0.20)], target_le="2.0", objective=0.9),
        {"140m": burn_expectations("chat", {"ttft": {"Slow"}})},
    ),
    # ITL is its own SLI: an ITL burn pages as ITL, TTFT stays silent.
    "itl-fast-burn-pages": Scenario(
        latency("itl", "chat", [(20, 0.30)], target_le="0.1"),
        {"10m": burn_expectations("chat", {"itl": {"Fast"}})},
    ),
    "itl-medium-burn-pages": Scenario(
        latency("itl", "chat", [(60, 0.08)], target_le="0.1"),
        {"50m": burn_expectations("chat", {"itl": {"Medium"}})},
    ),
    "itl-slow-burn-tickets": Scenario(
        latency("itl", "chat", [(150, 0.02)], target_le="0.1"),
        {"140m": burn_expectations("chat", {"itl": {"Slow"}})},
    ),
    # The good count is the bucket at each deployment's own target: the same latencies (none
    # over 2s, half over 1ms) are fine for a 2s target and a page for a 1ms target.
    "target-bucket-decides": Scenario(
        latency("ttft", "relaxed", [(20, 0.0)], target_le="2.0")
        + [
            {**s, "series": s["series"].replace('"relaxed"', '"strict"')}
            for s in latency("ttft", "relaxed", [(20, 0.0)], target_le="2.0")
            if "slo_target" not in s["series"]
        ]
        + [
            gauge(
                "kubellm_gateway_slo_target_seconds",
                'namespace="team-a", deployment="strict", model="strict", kind="ttft", le="0.001"',
                0.001,
                20,
            )
        ],
        {"10m": {"KubellmTTFTErrorBudgetBurnFast": [{"namespace": NS, "deployment": "strict"}]}},
    ),
    "fallback-share-high": Scenario(
        [
            counter(
                "kubellm_gateway_requests_total", f'{D}, target="fallback", code="200"', 30, 40
            ),
            counter("kubellm_gateway_requests_total", f'{D}, target="replica", code="200"', 70, 40),
            counter(
                "kubellm_gateway_requests_total",
                'namespace="team-a", deployment="calm", target="fallback", code="200"',
                5,
                40,
            ),
            counter(
                "kubellm_gateway_requests_total",
                'namespace="team-a", deployment="calm", target="replica", code="200"',
                95,
                40,
            ),
        ],
        {
            "10m": {"KubellmFallbackShareHigh": []},
            "30m": {"KubellmFallbackShareHigh": [{"namespace": NS, "deployment": "chat"}]},
        },
    ),
    "at-max-replicas-with-queue": Scenario(
        [
            counter("kubellm_autoscaler_decisions_total", f'{D}, reason="MaxReplicas"', 2, 40),
            gauge("kubellm_autoscaler_queue_depth", D, 3, 40),
            counter(
                "kubellm_autoscaler_decisions_total",
                'namespace="team-a", deployment="idle", reason="MaxReplicas"',
                2,
                40,
            ),
            gauge("kubellm_autoscaler_queue_depth", 'namespace="team-a", deployment="idle"', 0, 40),
            counter(
                "kubellm_autoscaler_decisions_total",
                'namespace="team-a", deployment="roomy", reason="QueueDepth"',
                2,
                40,
            ),
            gauge(
                "kubellm_autoscaler_queue_depth", 'namespace="team-a", deployment="roomy"', 5, 40
            ),
        ],
        {"30m": {"KubellmAtMaxReplicasWithQueue": [{"namespace": NS, "deployment": "chat"}]}},
    ),
    "kv-cache-nearly-full": Scenario(
        [
            gauge("vllm:kv_cache_usage_perc", f'job="kubellm-engine", {D}, pod="chat-0"', 0.97, 40),
            gauge("vllm:kv_cache_usage_perc", f'job="kubellm-engine", {D}, pod="chat-1"', 0.99, 40),
            gauge(
                "vllm:kv_cache_usage_perc",
                'job="kubellm-engine", namespace="team-a", deployment="ok", pod="ok-0"',
                0.8,
                40,
            ),
        ],
        {
            "10m": {"KubellmKVCacheNearlyFull": []},
            "20m": {"KubellmKVCacheNearlyFull": [{"namespace": NS, "deployment": "chat"}]},
        },
    ),
    "no-ready-replicas": Scenario(
        [
            gauge("kubellm_gateway_ready_endpoints", f'{D}, model="chat"', 0, 20),
            gauge("kubellm_autoscaler_desired_replicas", D, 2, 20),
            # scaled to zero on purpose: not an outage
            gauge(
                "kubellm_gateway_ready_endpoints",
                'namespace="team-a", deployment="asleep", model="asleep"',
                0,
                20,
            ),
            gauge(
                "kubellm_autoscaler_desired_replicas",
                'namespace="team-a", deployment="asleep"',
                0,
                20,
            ),
        ],
        {
            "3m": {"KubellmNoReadyReplicas": []},
            "10m": {"KubellmNoReadyReplicas": [{"namespace": NS, "deployment": "chat"}]},
        },
    ),
    "engine-scrape-failing": Scenario(
        [
            gauge("up", f'job="kubellm-engine", {D}, pod="chat-0"', 0, 20),
            gauge("up", f'job="kubellm-engine", {D}, pod="chat-1"', 1, 20),
            gauge(
                "kubellm_autoscaler_stale_replicas", 'namespace="team-a", deployment="other"', 1, 20
            ),
            gauge("kubellm_autoscaler_stale_replicas", D, 0, 20),
        ],
        {
            "15m": {
                "KubellmEngineScrapeFailing": [
                    {
                        "job": "kubellm-engine",
                        "namespace": NS,
                        "deployment": "chat",
                        "pod": "chat-0",
                    },
                    {"namespace": NS, "deployment": "other"},
                ]
            }
        },
    ),
}


def _expand(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)


def promtool_tests(scenario: Scenario, rules: dict[str, dict[str, Any]]) -> dict[str, Any]:
    checks = []
    for eval_time, alerts in scenario.expect.items():
        for name, firing in alerts.items():
            rule = rules[name]
            expected = []
            for extra in firing:
                labels = {**rule.get("labels", {}), **extra}
                annotations = {k: _expand(v, labels) for k, v in rule["annotations"].items()}
                expected.append({"exp_labels": labels, "exp_annotations": annotations})
            checks.append({"eval_time": eval_time, "alertname": name, "exp_alerts": expected})
    return {"interval": "1m", "input_series": scenario.series, "alert_rule_test": checks}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_alert_scenario(name: str, rule_file: Path, rules: dict, tmp_path: Path) -> None:
    doc = {
        "rule_files": [str(rule_file)],
        "evaluation_interval": "1m",
        "tests": [promtool_tests(SCENARIOS[name], rules)],
    }
    test_file = tmp_path / f"{name}.yaml"
    test_file.write_text(yaml.safe_dump(doc, sort_keys=False, width=1000))
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_scenario_and_a_first_check(rules: dict) -> None:
    covered = {a for s in SCENARIOS.values() for alerts in s.expect.values() for a in alerts}
    assert set(rules) <= covered, sorted(set(rules) - covered)
    fired = {
        a
        for s in SCENARIOS.values()
        for alerts in s.expect.values()
        for a, f in alerts.items()
        if f
    }
    assert set(rules) <= fired, f"alerts never shown firing: {sorted(set(rules) - fired)}"
    for name, rule in rules.items():
        assert "Check first" in rule["annotations"]["description"], name
        assert rule["labels"]["severity"] in ("page", "ticket", "warning"), name
        assert rule["annotations"]["runbook_url"].endswith("#" + name.lower().removesuffix(
            "fast").removesuffix("medium").removesuffix("slow")), name  # fmt: skip


def test_every_alert_has_a_runbook_section(rules: dict) -> None:
    headings = re.findall(r"^### (\w+)$", (ROOT / "docs" / "operations.md").read_text(), re.M)
    anchors = {h.lower() for h in headings}
    for name, rule in rules.items():
        anchor = rule["annotations"]["runbook_url"].rsplit("#", 1)[1]
        assert anchor in anchors, f"{name}: docs/operations.md has no '### ' heading for #{anchor}"
