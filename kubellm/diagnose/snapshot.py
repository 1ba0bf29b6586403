"""A fleet's health over a window, distilled from two scrapes of Prometheus text (pure).

`Snapshot` holds only the figures the triage tree reads; every field may be
None when the metric is not exported (a hosted fallback, an older engine).
Counters and histograms are differenced between the two scrapes, so figures
describe the window, not the process lifetime; gauges are read at the end.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics
from kubellm.metrics import GATEWAY_QUEUE_WAIT, histogram_quantile

# vLLM series beyond the core contract that the tree reads when present.
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
REQUEST_SUCCESS = "vllm:request_success_total"

Sample = tuple[str, dict[str, str], float]  # (sample name, labels, value)


def parse(text: str) -> list[Sample]:
    """Prometheus text -> samples; names as exposed (`_total`, `_bucket` kept)."""
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def _total(samples: Iterable[Sample], name: str, **match: str) -> float | None:
    values = [
        v
        for n, labels, v in samples
        if n == name and all(labels.get(k) == x for k, x in match.items())
    ]
    return sum(values) if values else None


def _values(samples: Iterable[Sample], name: str) -> list[float]:
    return [v for n, _, v in samples if n == name]


def _delta(before: list[Sample], after: list[Sample], name: str, **match: str) -> float | None:
    end = _total(after, name, **match)
    if end is None:
        return None
    start = _total(before, name, **match) or 0.0
    return end - start if end >= start else end  # a restart resets counters


def _buckets(samples: Iterable[Sample], name: str) -> dict[float, float]:
    out: dict[float, float] = defaultdict(float)
    for n, labels, v in samples:
        if n == name + "_bucket":
            out[float(labels["le"])] += v
    return out


def _quantile_delta(before: list[Sample], after: list[Sample], name: str, q: float) -> float | None:
    start, end = _buckets(before, name), _buckets(after, name)
    diff = [(le, count - start.get(le, 0.0)) for le, count in end.items()]
    if not diff or max(c for _, c in diff) <= 0:
        return None
    return histogram_quantile(q, diff)


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return top / bottom if top is not None and bottom else None


@dataclass
class Snapshot:
    window_s: float
    # latency, from the gateway (what clients feel) or else the engines
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None
    latency_source: str | None = None  # the metric the latencies came from
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    queue_wait_p95_s: float | None = None  # gateway admission queue
    # traffic
    request_rate: float | None = None  # gateway requests/s
    fallback_share: float | None = None  # of gateway requests, sent to the fallback API
    # engines
    engines: int = 0
    waiting: float | None = None  # sum over engines of their mean over the window's samples
    running: float | None = None  # same, requests in the running batch
    kv_cache_usage_max: float | None = None  # highest sample of any engine
    kv_cache_usage_mean: float | None = None
    prefix_cache_hit_rate: float | None = None  # tokens hit / tokens queried in the window
    mean_prompt_tokens: float | None = None  # prefill tokens / finished requests
    preemptions_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    # the gateway's learnt speed of each replica against its peers' median (slo-aware's
    # latency model, kubellm_gateway_replica_speed_factor), by URL
    speed_factors: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def build(
    window_s: float,
    gateway: tuple[str, str] | None,
    engines: Sequence[Sequence[str]],
    *,
    ttft_target_s: float | None = None,
    itl_target_s: float | None = None,
) -> Snapshot:
    """A snapshot from the gateway's (before, after) metrics texts and each engine's scrapes.

    An engine's scrapes are [start, ..., end]: counters and histograms use the
    first and the last; gauges (queue, batch, KV use) are averaged over all but
    the first, so one quiet instant at the end does not hide a busy window.
    """
    snap = Snapshot(window_s=window_s, ttft_target_s=ttft_target_s, itl_target_s=itl_target_s)
    if gateway is not None:
        g0, g1 = parse(gateway[0]), parse(gateway[1])
        if _quantile_delta(g0, g1, metrics.GATEWAY_TTFT, 0.5) is not None:
            snap.latency_source = "gateway (kubellm_gateway_*)"
            snap.ttft_p50_s = _quantile_delta(g0, g1, metrics.GATEWAY_TTFT, 0.5)
            snap.ttft_p95_s = _quantile_delta(g0, g1, metrics.GATEWAY_TTFT, 0.95)
            snap.itl_p50_s = _quantile_delta(g0, g1, metrics.GATEWAY_ITL, 0.5)
            snap.itl_p95_s = _quantile_delta(g0, g1, metrics.GATEWAY_ITL, 0.95)
        snap.queue_wait_p95_s = _quantile_delta(g0, g1, GATEWAY_QUEUE_WAIT, 0.95)
        requests = _delta(g0, g1, metrics.GATEWAY_REQUESTS)
        if requests is not None:
            snap.request_rate = requests / window_s
            fallback = _delta(g0, g1, metrics.GATEWAY_REQUESTS, target="fallback") or 0.0
            snap.fallback_share = fallback / requests if requests > 0 else None
        snap.speed_factors = {
            labels.get("url", ""): value
            for name, labels, value in g1
            if name == metrics.GATEWAY_SPEED_FACTOR and labels.get("url")
        }
        if snap.ttft_target_s is None:
            snap.ttft_target_s = _total(g1, metrics.GATEWAY_SLO_TARGET, kind="ttft")
        if snap.itl_target_s is None:
            snap.itl_target_s = _total(g1, metrics.GATEWAY_SLO_TARGET, kind="itl")
    scrapes = [[parse(text) for text in texts] for texts in engines]
    if any(len(texts) < 2 for texts in scrapes):
        raise ValueError("engines: each needs at least two scrapes (start and end of the window)")
    snap.engines = len(scrapes)
    if scrapes:
        _engines(snap, scrapes, window_s)
    return snap


def _gauge_mean(scrapes: list[list[list[Sample]]], name: str) -> float | None:
    """Sum over engines of each engine's mean over its scrapes after the first."""
    means = []
    for texts in scrapes:
        values = [v for v in (_total(t, name) for t in texts[1:]) if v is not None]
        if values:
            means.append(sum(values) / len(values))
    return sum(means) if means else None


def _engines(snap: Snapshot, scrapes: list[list[list[Sample]]], window: float) -> None:
    before = [s for texts in scrapes for s in texts[0]]
    after = [s for texts in scrapes for s in texts[-1]]
    if (
        snap.latency_source is None
        and _quantile_delta(before, after, metrics.TIME_TO_FIRST_TOKEN, 0.5) is not None
    ):
        snap.latency_source = "engines (vllm:*)"
        snap.ttft_p50_s = _quantile_delta(before, after, metrics.TIME_TO_FIRST_TOKEN, 0.5)
        snap.ttft_p95_s = _quantile_delta(before, after, metrics.TIME_TO_FIRST_TOKEN, 0.95)
        snap.itl_p50_s = _quantile_delta(before, after, metrics.INTER_TOKEN_LATENCY, 0.5)
        snap.itl_p95_s = _quantile_delta(before, after, metrics.INTER_TOKEN_LATENCY, 0.95)
    snap.waiting = _gauge_mean(scrapes, metrics.NUM_REQUESTS_WAITING)
    snap.running = _gauge_mean(scrapes, metrics.NUM_REQUESTS_RUNNING)
    usages = [v for texts in scrapes for t in texts[1:] for v in _values(t, metrics.KV_CACHE_USAGE)]
    if usages:
        snap.kv_cache_usage_max = max(usages)
        snap.kv_cache_usage_mean = sum(usages) / len(usages)
    hits = _delta(before, after, metrics.PREFIX_CACHE_HITS)
    snap.prefix_cache_hit_rate = _ratio(hits, _delta(before, after, metrics.PREFIX_CACHE_QUERIES))
    snap.mean_prompt_tokens = _ratio(
        _delta(before, after, PROMPT_TOKENS), _delta(before, after, REQUEST_SUCCESS)
    )
    preemptions = _delta(before, after, PREEMPTIONS)
    snap.preemptions_per_s = None if preemptions is None else preemptions / window
    generated = _delta(before, after, GENERATION_TOKENS)
    snap.generation_tokens_per_s = None if generated is None else generated / window
