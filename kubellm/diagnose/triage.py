"""The serving triage tree, as a pure function: `triage(snapshot) -> [Finding]`.

The order follows the serving lesson: first make sure there is capacity at all
(overflow), then look at the first token (queueing or long prompts), then at
the stream after it (decode pressure), and only when latency is fine, at cost
(idle capacity). Each finding carries the figures that triggered it, with the
metric they came from, and what to try.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kubellm import api, metrics
from kubellm.diagnose.snapshot import (
    GATEWAY_QUEUE_WAIT,
    PREEMPTIONS,
    PROMPT_TOKENS,
    Snapshot,
)


@dataclass(frozen=True)
class Thresholds:
    """When a figure counts as a symptom. Defaults suit interactive chat traffic."""

    ttft_target_s: float = 2.0  # used when neither the CLI nor the gateway gives one
    itl_target_s: float = 0.25
    overflow_share: float = 0.05  # of requests sent to the fallback API
    queue_share_of_ttft: float = 0.5  # queue wait p95 over TTFT p95: "mostly queueing"
    long_prompt_tokens: float = 2048.0
    low_prefix_hit_rate: float = 0.3
    kv_full: float = 0.9
    idle_kv: float = 0.2  # KV use below this, with no queue, is idle capacity
    idle_running_per_engine: float = 1.0
    slow_replica: float = 1.3  # a replica's speed factor over its peers' median


@dataclass
class Finding:
    code: str  # stable identifier: overflow | ttft-queueing | decode-pressure | ...
    title: str
    evidence: dict[str, float] = field(default_factory=dict)  # "metric (statistic)" -> value
    suggestions: list[str] = field(default_factory=list)


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def _targets(snap: Snapshot, t: Thresholds) -> tuple[float, float]:
    return (
        snap.ttft_target_s if snap.ttft_target_s is not None else t.ttft_target_s,
        snap.itl_target_s if snap.itl_target_s is not None else t.itl_target_s,
    )


def _latency_names(snap: Snapshot) -> tuple[str, str]:
    if snap.latency_source and snap.latency_source.startswith("engines"):
        return metrics.TIME_TO_FIRST_TOKEN, metrics.INTER_TOKEN_LATENCY
    return metrics.GATEWAY_TTFT, metrics.GATEWAY_ITL


def no_traffic(snap: Snapshot) -> bool:
    """No request reached the fleet in the window (nothing to judge latency by)."""
    if snap.request_rate is not None:
        return snap.request_rate == 0 and not snap.running and not snap.waiting
    return (
        snap.ttft_p95_s is None
        and not snap.running
        and not snap.waiting
        and not snap.generation_tokens_per_s
    )


class _Advice:
    """Suggestions worded for the manifest, when it is known (else for any fleet)."""

    def __init__(self, spec: api.LLMDeploymentSpec | None) -> None:
        self.spec = spec
        scaling = spec.autoscaling if spec is not None else None
        self.autoscaling = scaling if scaling is not None and scaling.enabled else None
        self.known = spec is not None

    def more_replicas(self) -> str:
        if self.autoscaling is not None:
            return (
                f"raise autoscaling.maxReplicas (now {self.autoscaling.max_replicas}) or add "
                "GPUs; the fleet cannot absorb the load"
            )
        if self.known:
            assert self.spec is not None
            return (
                f"autoscaling is off: raise spec.replicas (now {self.spec.replicas}) or turn "
                "on spec.autoscaling; the fleet cannot absorb the load"
            )
        return "raise autoscaling.maxReplicas (or spec.replicas) or add GPUs"

    def scale_sooner(self, what: str) -> list[str]:
        if self.autoscaling is None:
            return [] if self.known else [f"with autoscaling on: {what}"]
        a = self.autoscaling
        return [
            f"{what} (now targetKVCacheUsage {a.target_kv_cache_usage:g}, targetQueueDepth "
            f"{a.target_queue_depth:g}, scaleUpStabilizationSeconds "
            f"{a.scale_up_stabilization_seconds})"
        ]

    def fewer_replicas(self) -> str:
        if self.autoscaling is not None:
            return (
                f"run fewer replicas (lower autoscaling.minReplicas, now "
                f"{self.autoscaling.min_replicas}) or consolidate models onto shared GPUs"
            )
        if self.known:
            assert self.spec is not None
            return (
                f"run fewer replicas (spec.replicas, now {self.spec.replicas}) or turn on "
                "spec.autoscaling so the count follows the load"
            )
        return (
            "run fewer replicas (lower autoscaling.minReplicas) or consolidate models onto "
            "shared GPUs"
        )

    def scale_to_zero(self) -> list[str]:
        if self.autoscaling is not None and self.autoscaling.scale_to_zero:
            return []
        where = (
            "autoscaling.scaleToZero"
            if self.autoscaling is not None or not self.known
            else ("spec.autoscaling with scaleToZero")
        )
        return [
            f"enable {where} for models with idle hours; the fallback API serves the cold start"
        ]

    def chunked_prefill(self) -> str:
        engine = self.spec.engine if self.spec is not None else None
        if engine is not None and engine.chunked_prefill.enabled:
            return (
                "lower engine.chunkedPrefill.maxNumBatchedTokens (now "
                f"{engine.chunked_prefill.max_num_batched_tokens}) so a long prefill takes "
                "less of each step"
            )
        return (
            "enable chunked prefill (engine.chunkedPrefill.maxNumBatchedTokens) so "
            "long prefills do not block the batch"
        )

    def prefix_caching(self) -> str:
        if self.spec is None:
            return "turn on prefix caching (engine.prefixCaching) and prefix-aware routing"
        missing = []
        if not self.spec.engine.prefix_caching:
            missing.append("engine.prefixCaching: true")
        if self.spec.routing.policy != "prefix-aware":
            missing.append(f"routing.policy: prefix-aware (now {self.spec.routing.policy})")
        if missing:
            return "set " + " and ".join(missing)
        return "prefix caching and prefix-aware routing are on: the prompts share little"


def triage(
    snap: Snapshot,
    thresholds: Thresholds | None = None,
    spec: api.LLMDeploymentSpec | None = None,
) -> list[Finding]:
    """Walk the tree; an empty list means nothing looks wrong in this window.

    With the deployment's `spec`, suggestions name what to change in that manifest
    (and skip what it already does); without it they are worded for any fleet.
    """
    t = thresholds or Thresholds()
    advice = _Advice(spec)
    ttft_target, itl_target = _targets(snap, t)
    ttft_name, itl_name = _latency_names(snap)
    findings: list[Finding] = []

    if no_traffic(snap):
        evidence = {"engines": float(snap.engines)}
        if snap.request_rate is not None:
            evidence[f"{metrics.GATEWAY_REQUESTS} (req/s)"] = snap.request_rate
        return [
            Finding(
                "no-traffic",
                f"No requests in the {snap.window_s:.3g}s window: nothing to judge latency by",
                evidence,
                [
                    "run diagnose while the fleet serves traffic (e.g. alongside "
                    "`kubellm bench`), or widen --window",
                ],
            )
        ]

    if snap.fallback_share is not None and snap.fallback_share >= t.overflow_share:
        findings.append(
            Finding(
                "overflow",
                "Capacity is below demand: requests overflow to the fallback API",
                {
                    f"{metrics.GATEWAY_REQUESTS}{{target=fallback}} (share)": snap.fallback_share,
                    **(
                        {f"{metrics.GATEWAY_REQUESTS} (req/s)": snap.request_rate}
                        if snap.request_rate is not None
                        else {}
                    ),
                },
                [
                    advice.more_replicas(),
                    *advice.scale_sooner(
                        "scale up sooner: lower targetKVCacheUsage / targetQueueDepth or the "
                        "scale-up stabilization window"
                    ),
                    "if bursts are short, the fallback is doing its job; check its cost",
                ],
            )
        )

    ttft_high = snap.ttft_p95_s is not None and snap.ttft_p95_s > ttft_target
    itl_high = snap.itl_p95_s is not None and snap.itl_p95_s > itl_target
    latency = {}
    if snap.ttft_p95_s is not None:
        latency[f"{ttft_name} (p95)"] = snap.ttft_p95_s
    if snap.itl_p95_s is not None:
        latency[f"{itl_name} (p95)"] = snap.itl_p95_s

    if ttft_high and not itl_high:
        findings.append(_ttft_finding(snap, t, latency, ttft_target, advice))
    elif itl_high and not ttft_high:
        findings.append(_decode_finding(snap, t, latency, itl_target))
    elif ttft_high and itl_high:
        decode = _decode_finding(snap, t, latency, itl_target)
        findings.append(
            Finding(
                "saturated",
                f"Both TTFT (> {_fmt(ttft_target)}s) and ITL (> {_fmt(itl_target)}s) "
                "are over target: the replicas are saturated",
                decode.evidence,
                [
                    "scale out first: more replicas relieve both queueing and batch pressure",
                    *decode.suggestions[1:],
                ],
            )
        )
    elif snap.ttft_p95_s is not None or snap.request_rate is not None or snap.engines:
        idle = _idle_finding(snap, t, latency, advice)
        if idle is not None:
            findings.append(idle)
    findings += _slow_replicas(snap, t)
    return findings


def _slow_replicas(snap: Snapshot, t: Thresholds) -> list[Finding]:
    """Replicas the gateway learnt to be slower than their peers at the same batch."""
    out = []
    for url, factor in sorted(snap.speed_factors.items(), key=lambda kv: -kv[1]):
        if factor < t.slow_replica:
            continue
        out.append(
            Finding(
                "slow-replica",
                f"{url} is {factor:.1f}x slower than its peers at the same batch",
                {f"{metrics.GATEWAY_SPEED_FACTOR}{{url={url}}}": factor},
                [
                    "check that replica's node: an older or throttled GPU, a noisy neighbour, "
                    "another model's process on the same card",
                    "spec.routing.policy slo-aware routes around it (it already learnt this); "
                    "other policies keep sending it a full share",
                ],
            )
        )
    return out


def _ttft_finding(
    snap: Snapshot, t: Thresholds, latency: dict[str, float], ttft_target: float, advice: _Advice
) -> Finding:
    """Slow first token, smooth stream: queueing, or long prompts to prefill."""
    evidence = dict(latency)
    suggestions: list[str] = []
    causes: list[str] = []
    queueing = (snap.waiting or 0) > 0 or (
        snap.queue_wait_p95_s is not None
        and snap.ttft_p95_s is not None
        and snap.queue_wait_p95_s >= t.queue_share_of_ttft * snap.ttft_p95_s
    )
    if snap.queue_wait_p95_s is not None:
        evidence[f"{GATEWAY_QUEUE_WAIT} (p95)"] = snap.queue_wait_p95_s
    if snap.waiting is not None:
        evidence[f"{metrics.NUM_REQUESTS_WAITING} (sum)"] = snap.waiting
    if queueing:
        causes.append("requests queue")
        if advice.autoscaling is not None:
            suggestions.append(
                "scale out: add replicas (lower autoscaling.targetQueueDepth, now "
                f"{advice.autoscaling.target_queue_depth:g}, so the autoscaler reacts to the "
                "queue sooner)"
            )
        elif advice.known:
            suggestions.append(advice.more_replicas())
        else:
            suggestions.append(
                "scale out: add replicas (lower targetQueueDepth so the autoscaler "
                "reacts to the queue sooner)"
            )
    long_prompts = (
        snap.mean_prompt_tokens is not None and snap.mean_prompt_tokens >= t.long_prompt_tokens
    )
    if snap.mean_prompt_tokens is not None:
        evidence[f"{PROMPT_TOKENS} per request (mean)"] = snap.mean_prompt_tokens
    if snap.prefix_cache_hit_rate is not None:
        evidence[f"{metrics.PREFIX_CACHE_HITS} / {metrics.PREFIX_CACHE_QUERIES}"] = (
            snap.prefix_cache_hit_rate
        )
    if long_prompts:
        causes.append("prompts are long")
        suggestions.append(advice.chunked_prefill())
    cold = (
        snap.prefix_cache_hit_rate is not None
        and snap.prefix_cache_hit_rate < t.low_prefix_hit_rate
    )
    if cold and (long_prompts or not queueing):
        causes.append("the prefix cache rarely hits")
        suggestions += [
            advice.prefix_caching(),
            "put the shared part of prompts first and keep it stable; shorten the "
            "shared system prompt",
        ]
    if not suggestions:
        suggestions = [
            "scale out (more replicas) or enable chunked prefill and prefix caching; "
            "the engines do not export enough to tell queueing from prefill"
        ]
    why = " and ".join(causes) if causes else "queueing or prefill"
    return Finding(
        "ttft-queueing",
        f"First token is slow (TTFT p95 > {_fmt(ttft_target)}s) while streaming is fine: {why}",
        evidence,
        suggestions,
    )


def _decode_finding(
    snap: Snapshot, t: Thresholds, latency: dict[str, float], itl_target: float
) -> Finding:
    """Good first token, slow stream: too much decode work per step, or memory pressure."""
    evidence = dict(latency)
    if snap.running is not None:
        evidence[f"{metrics.NUM_REQUESTS_RUNNING} (sum)"] = snap.running
        if snap.engines:
            evidence[f"{metrics.NUM_REQUESTS_RUNNING} (per engine)"] = snap.running / snap.engines
    if snap.kv_cache_usage_max is not None:
        evidence[f"{metrics.KV_CACHE_USAGE} (max)"] = snap.kv_cache_usage_max
    if snap.preemptions_per_s is not None:
        evidence[f"{PREEMPTIONS} (per s)"] = snap.preemptions_per_s
    suggestions = ["add replicas to spread the decode batch"]
    kv_full = snap.kv_cache_usage_max is not None and snap.kv_cache_usage_max >= t.kv_full
    preempting = (snap.preemptions_per_s or 0) > 0
    if kv_full or preempting:
        suggestions += [
            "KV cache is (nearly) full: lower engine.maxNumSeqs, or quantize the KV "
            "cache (engine.kvCacheDtype: fp8) to fit more sequences"
        ]
    suggestions += [
        "lower engine.maxNumSeqs: smaller batches stream faster per request",
        "quantize the weights (engine.quantization): fewer bytes read per decode step",
    ]
    return Finding(
        "decode-pressure",
        f"Streaming is slow (ITL p95 > {_fmt(itl_target)}s) after a good first token: "
        "decode pressure"
        + (" with the KV cache near full" if kv_full else "")
        + (" and preemptions" if preempting else ""),
        evidence,
        suggestions,
    )


def _idle_finding(
    snap: Snapshot, t: Thresholds, latency: dict[str, float], advice: _Advice
) -> Finding | None:
    """Fine latency on mostly idle replicas: paying for capacity nobody uses."""
    if not snap.engines or snap.kv_cache_usage_max is None or snap.running is None:
        return None
    per_engine = snap.running / snap.engines
    if snap.kv_cache_usage_max >= t.idle_kv or per_engine >= t.idle_running_per_engine:
        return None
    if (snap.waiting or 0) > 0:
        return None
    evidence = {
        **latency,
        f"{metrics.KV_CACHE_USAGE} (max)": snap.kv_cache_usage_max,
        f"{metrics.NUM_REQUESTS_RUNNING} (per engine)": per_engine,
        "engines": float(snap.engines),
    }
    if snap.request_rate is not None:
        evidence[f"{metrics.GATEWAY_REQUESTS} (req/s)"] = snap.request_rate
    suggestions = []
    if snap.engines > 1:
        suggestions.append(advice.fewer_replicas())
    suggestions += advice.scale_to_zero()
    if not suggestions:
        suggestions.append("scale-to-zero is on: the replicas go once the idle time passes")
    return Finding(
        "low-utilization",
        "Latency is fine but the replicas are mostly idle: low utilization "
        "makes every token expensive",
        evidence,
        suggestions,
    )


def format_findings(snap: Snapshot, findings: list[Finding]) -> str:
    """Findings for people, with their evidence."""
    source = (
        f"latency from {snap.latency_source}"
        if snap.latency_source
        else "no latency figures (no requests in the window)"
    )
    lines = [f"window {snap.window_s:.3g}s, {snap.engines} engine(s), {source}"]
    if not findings:
        lines.append("no problem found: latency within targets, no overflow, capacity in use")
    for i, f in enumerate(findings, 1):
        lines.append(f"{i}. [{f.code}] {f.title}")
        for name, value in f.evidence.items():
            lines.append(f"     {name} = {_fmt(value)}")
        for s in f.suggestions:
            lines.append(f"     -> {s}")
    return "\n".join(lines)
