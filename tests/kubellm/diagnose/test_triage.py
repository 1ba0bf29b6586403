"""The triage tree, branch by branch: a snapshot that triggers it and one that does not."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kubellm import metrics
from kubellm.diagnose.snapshot import GATEWAY_QUEUE_WAIT, PREEMPTIONS, Snapshot
from kubellm.diagnose.triage import Thresholds, format_findings, triage

HEALTHY = Snapshot(
    window_s=30,
    ttft_p50_s=0.2,
    ttft_p95_s=0.5,
    itl_p50_s=0.03,
    itl_p95_s=0.05,
    latency_source="gateway (kubellm_gateway_*)",
    ttft_target_s=2.0,
    itl_target_s=0.25,
    queue_wait_p95_s=0.01,
    request_rate=5.0,
    fallback_share=0.0,
    engines=2,
    waiting=0,
    running=12,
    kv_cache_usage_max=0.5,
    kv_cache_usage_mean=0.45,
    prefix_cache_hit_rate=0.6,
    mean_prompt_tokens=500,
    preemptions_per_s=0.0,
    generation_tokens_per_s=900,
)


def codes(snap: Snapshot, **kwargs: Any) -> list[str]:
    return [f.code for f in triage(snap, **kwargs)]


def test_a_healthy_busy_fleet_has_no_findings() -> None:
    assert triage(HEALTHY) == []
    assert "no problem found" in format_findings(HEALTHY, [])


@pytest.mark.parametrize(
    ("changes", "code", "present"),
    [
        ({"fallback_share": 0.2}, "overflow", True),
        ({"fallback_share": 0.01}, "overflow", False),
        ({"ttft_p95_s": 6.0, "waiting": 14, "queue_wait_p95_s": 4.5}, "ttft-queueing", True),
        ({"ttft_p95_s": 1.5, "waiting": 14, "queue_wait_p95_s": 1.0}, "ttft-queueing", False),
        (
            {"itl_p95_s": 0.6, "kv_cache_usage_max": 0.97, "preemptions_per_s": 0.4},
            "decode-pressure",
            True,
        ),
        ({"itl_p95_s": 0.2, "kv_cache_usage_max": 0.97}, "decode-pressure", False),
        ({"ttft_p95_s": 6.0, "itl_p95_s": 0.6}, "saturated", True),
        ({"ttft_p95_s": 6.0}, "saturated", False),
        ({"kv_cache_usage_max": 0.03, "running": 0, "request_rate": 0.1}, "low-utilization", True),
        ({"kv_cache_usage_max": 0.03, "running": 0, "waiting": 3}, "low-utilization", False),
        ({"kv_cache_usage_max": 0.5, "running": 1}, "low-utilization", False),
        ({"speed_factors": {"http://a": 1.0, "http://b": 1.6}}, "slow-replica", True),
        ({"speed_factors": {"http://a": 1.0, "http://b": 1.1}}, "slow-replica", False),
    ],
)
def test_each_branch_fires_only_on_its_symptoms(
    changes: dict[str, Any], code: str, present: bool
) -> None:
    assert (code in codes(replace(HEALTHY, **changes))) is present


def test_overflow_names_the_share_of_fallback_requests() -> None:
    [finding] = triage(replace(HEALTHY, fallback_share=0.3))
    assert finding.evidence[f"{metrics.GATEWAY_REQUESTS}{{target=fallback}} (share)"] == 0.3
    assert any("maxReplicas" in s for s in finding.suggestions)


def test_slow_first_token_from_queueing_suggests_scaling_out() -> None:
    snap = replace(HEALTHY, ttft_p95_s=6.0, waiting=14, queue_wait_p95_s=4.5)
    [finding] = triage(snap)
    assert finding.evidence[f"{metrics.GATEWAY_TTFT} (p95)"] == 6.0
    assert finding.evidence[f"{GATEWAY_QUEUE_WAIT} (p95)"] == 4.5
    assert finding.evidence[f"{metrics.NUM_REQUESTS_WAITING} (sum)"] == 14
    assert "requests queue" in finding.title
    assert any(s.startswith("scale out") for s in finding.suggestions)
    assert not any("chunked prefill" in s for s in finding.suggestions)


def test_slow_first_token_from_long_uncached_prompts_suggests_prefill_fixes() -> None:
    snap = replace(
        HEALTHY,
        ttft_p95_s=5.0,
        waiting=0,
        queue_wait_p95_s=0.05,
        mean_prompt_tokens=6000,
        prefix_cache_hit_rate=0.05,
    )
    [finding] = triage(snap)
    assert "prompts are long" in finding.title and "prefix cache rarely hits" in finding.title
    text = " ".join(finding.suggestions)
    assert "chunked prefill" in text and "prefix caching" in text and "shared" in text
    assert not any(s.startswith("scale out") for s in finding.suggestions)
    assert finding.evidence["vllm:prompt_tokens_total per request (mean)"] == 6000


def test_slow_stream_with_a_full_kv_cache_names_batch_kv_and_preemptions() -> None:
    snap = replace(
        HEALTHY, itl_p95_s=0.6, kv_cache_usage_max=0.97, preemptions_per_s=0.4, running=60
    )
    [finding] = triage(snap)
    assert finding.code == "decode-pressure" and "KV cache near full" in finding.title
    assert finding.evidence[f"{metrics.KV_CACHE_USAGE} (max)"] == 0.97
    assert finding.evidence[f"{PREEMPTIONS} (per s)"] == 0.4
    assert finding.evidence[f"{metrics.NUM_REQUESTS_RUNNING} (per engine)"] == 30
    text = " ".join(finding.suggestions)
    assert "maxNumSeqs" in text and "quantiz" in text and "replicas" in text


def test_idle_fleet_suggests_fewer_replicas_and_a_single_idle_replica_scale_to_zero() -> None:
    idle = replace(HEALTHY, kv_cache_usage_max=0.02, running=0, request_rate=0.05, engines=3)
    [finding] = triage(idle)
    assert finding.code == "low-utilization"
    assert any("fewer replicas" in s for s in finding.suggestions)
    assert finding.evidence["engines"] == 3
    [single] = triage(replace(idle, engines=1))
    assert not any("fewer replicas" in s for s in single.suggestions)
    assert any("scaleToZero" in s for s in single.suggestions)


def test_targets_come_from_the_snapshot_then_the_thresholds() -> None:
    tight = replace(HEALTHY, ttft_target_s=0.4)
    assert codes(tight) == ["ttft-queueing"]
    untargeted = replace(HEALTHY, ttft_target_s=None, itl_target_s=None, ttft_p95_s=1.5)
    assert codes(untargeted) == []
    assert codes(untargeted, thresholds=Thresholds(ttft_target_s=1.0)) == ["ttft-queueing"]


def test_engine_latencies_are_named_after_the_engine_metrics() -> None:
    snap = replace(HEALTHY, latency_source="engines (vllm:*)", itl_p95_s=0.6)
    [finding] = triage(snap)
    assert f"{metrics.INTER_TOKEN_LATENCY} (p95)" in finding.evidence


def test_overflow_and_latency_findings_are_reported_together_and_formatted() -> None:
    snap = replace(HEALTHY, fallback_share=0.5, ttft_p95_s=6.0, waiting=9)
    findings = triage(snap)
    assert [f.code for f in findings] == ["overflow", "ttft-queueing"]
    text = format_findings(snap, findings)
    assert "1. [overflow]" in text and "2. [ttft-queueing]" in text
    assert f"{metrics.GATEWAY_TTFT} (p95) = 6" in text


def test_a_slow_replica_is_named_with_its_factor() -> None:
    snap = replace(HEALTHY, speed_factors={"http://127.0.0.1:9003": 1.62, "http://a": 0.98})
    (finding,) = triage(snap)
    assert finding.title == "http://127.0.0.1:9003 is 1.6x slower than its peers at the same batch"
    assert finding.evidence == {
        f"{metrics.GATEWAY_SPEED_FACTOR}{{url=http://127.0.0.1:9003}}": 1.62
    }
