"""A fleet's state for people: one row per model, from the gateway's and engines' metrics.

Pure functions turn Prometheus text into rows; `kubellm status` and the live
line of `kubellm up` print them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics


def _families(text: str) -> dict[str, list[tuple[dict[str, str], float, str]]]:
    """metric family name -> [(labels, value, sample name)]."""
    out: dict[str, list[tuple[dict[str, str], float, str]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[family.name].append((dict(sample.labels), sample.value, sample.name))
    return out


def _quantiles(samples: list[tuple[dict[str, str], float, str]], model: str) -> dict[str, float]:
    buckets: dict[float, float] = defaultdict(float)
    for labels, value, name in samples:
        if name.endswith("_bucket") and labels.get("model") == model:
            buckets[float(labels["le"])] += value
    out = {}
    for q in (0.5, 0.95):
        value = metrics.histogram_quantile(q, buckets.items())
        if value is not None:
            out[f"p{int(q * 100)}"] = value
    return out


@dataclass
class ModelRow:
    model: str
    replicas_ready: int = 0
    replicas_desired: int = 0
    queue: float = 0.0
    kv_cache_usage: float | None = None
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    itl_p50: float | None = None
    itl_p95: float | None = None
    requests: float = 0.0
    fallback_share: float | None = None
    adapters: list[dict[str, int | str]] | None = None  # status.adapters (the autoscaler's)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def model_row(
    model: str, gateway_text: str, engine_texts: list[str], *, ready: int, desired: int
) -> ModelRow:
    """Summarise one model from the gateway's /metrics and its engines' /metrics."""
    gateway = _families(gateway_text)
    row = ModelRow(model=model, replicas_ready=ready, replicas_desired=desired)
    ttft = _quantiles(gateway.get(metrics.GATEWAY_TTFT, []), model)
    itl = _quantiles(gateway.get(metrics.GATEWAY_ITL, []), model)
    row.ttft_p50, row.ttft_p95 = ttft.get("p50"), ttft.get("p95")
    row.itl_p50, row.itl_p95 = itl.get("p50"), itl.get("p95")
    by_target: dict[str, float] = defaultdict(float)
    for labels, value, name in gateway.get(metrics.GATEWAY_REQUESTS.removesuffix("_total"), []):
        if name.endswith("_total") and labels.get("model") == model:
            by_target[labels.get("target", "replica")] += value
    row.requests = sum(by_target.values())
    if row.requests:
        row.fallback_share = by_target.get("fallback", 0.0) / row.requests
    usages = []
    for text in engine_texts:
        engine = _families(text)
        row.queue += sum(v for _, v, _ in engine.get(metrics.NUM_REQUESTS_WAITING, []))
        usages += [v for _, v, _ in engine.get(metrics.KV_CACHE_USAGE, [])]
    if usages:
        row.kv_cache_usage = sum(usages) / len(usages)
    return row


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


HEADER = ("MODEL", "READY", "QUEUE", "KV", "TTFT p50/p95", "ITL p50/p95", "REQS", "FALLBACK")


def format_table(rows: list[ModelRow]) -> str:
    lines = [HEADER]
    for r in rows:
        lines.append(
            (
                r.model,
                f"{r.replicas_ready}/{r.replicas_desired}",
                f"{r.queue:.0f}",
                _pct(r.kv_cache_usage),
                f"{_ms(r.ttft_p50)}/{_ms(r.ttft_p95)}",
                f"{_ms(r.itl_p50)}/{_ms(r.itl_p95)}",
                f"{r.requests:.0f}",
                _pct(r.fallback_share),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)  # fmt: skip


def format_adapters(rows: list[ModelRow]) -> str:
    """The LoRA adapters of each model: loaded on N of M ready replicas, active on K."""
    lines = [("MODEL", "ADAPTER", "LOADED", "ACTIVE")]
    for r in rows:
        for a in r.adapters or []:
            replicas = a.get("replicas", 0)
            lines.append(
                (
                    r.model,
                    str(a.get("name", "")),
                    f"{a.get('loadedReplicas', 0)}/{replicas}",
                    f"{a.get('activeReplicas', 0)}/{replicas}",
                )
            )
    if len(lines) == 1:
        return ""
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)  # fmt: skip
