"""The canary analysis' figures: the gateway's per-revision counters of one model.

`parse` is pure (Prometheus text in, cumulative `Counters` per revision out);
`GatewayFigures` reads one or more gateways' `/metrics` (each gateway replica counts
what it routed, so their counters add up) with a timeout and a bound on the answer.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics

from .rollout import Counters

log = logging.getLogger(__name__)

MAX_METRICS_BYTES = 16 * 2**20  # a gateway's /metrics is a few hundred KiB


def parse(text: str, model: str, namespace: str | None = None) -> dict[str, Counters]:
    """Cumulative counters per revision of `model` (served name) from a gateway's /metrics."""
    fields: dict[str, dict[str, float]] = {}

    def add(labels: Mapping[str, str], key: str, value: float) -> None:
        if labels.get("model") != model or not labels.get("revision"):
            return
        if namespace is not None and labels.get("namespace") not in (None, "", namespace):
            return
        bucket = fields.setdefault(labels["revision"], {})
        bucket[key] = bucket.get(key, 0.0) + value

    histograms = {
        metrics.GATEWAY_REVISION_TTFT: "ttft",
        metrics.GATEWAY_REVISION_ITL: "itl",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = detail_key(sample.name, sample.labels)
            if key is not None:
                add(sample.labels, key, sample.value)
            elif sample.name == metrics.GATEWAY_REVISION_REQUESTS:
                add(sample.labels, "requests", sample.value)
                if sample.labels.get("outcome") == "error":
                    add(sample.labels, "errors", sample.value)
            elif sample.name == metrics.GATEWAY_REVISION_SLO_MET:
                add(sample.labels, "slo_met", sample.value)
            else:
                for base, key in histograms.items():
                    if sample.name == f"{base}_sum":
                        add(sample.labels, f"{key}_sum", sample.value)
                    elif sample.name == f"{base}_count":
                        add(sample.labels, f"{key}_count", sample.value)
    return {revision: counters(values) for revision, values in fields.items()}


def counters(values: Mapping[str, float]) -> Counters:
    """Counters from the summed fields (the detail keys apart)."""
    return Counters.from_status(values) or Counters()


# The per-class series of the analysis (Counters.detail), by metric: the detail key's head.
DETAIL_SERIES = {
    metrics.GATEWAY_REVISION_CLASS_REQUESTS: "class_requests",
    metrics.GATEWAY_REVISION_CLIENTS: "clients",
    f"{metrics.GATEWAY_REVISION_STREAM_TTFT}_bucket": "stream_ttft",
    f"{metrics.GATEWAY_REVISION_TPOT}_bucket": "tpot",
    metrics.GATEWAY_MIRROR_REQUESTS: "mirrored",
    metrics.GATEWAY_MIRROR_AGREED: "agreed",
    metrics.GATEWAY_MIRROR_TOKENS: "tokens",
    metrics.GATEWAY_MIRROR_TOKENS_AGREED: "tokens_agreed",
    f"{metrics.GATEWAY_MIRROR_DIVERGENCE}_sum": "divergence_sum",
    f"{metrics.GATEWAY_MIRROR_DIVERGENCE}_count": "divergence_count",
    f"{metrics.GATEWAY_MIRROR_TPOT}_bucket": "mirror_tpot",
    f"{metrics.GATEWAY_MIRROR_STABLE_TPOT}_bucket": "mirror_stable_tpot",
}


def detail_key(name: str, labels: Mapping[str, str]) -> str | None:
    """The Counters.detail key of one sample of a per-class series; None for others."""
    head = DETAIL_SERIES.get(name)
    if head is None:
        return None
    parts = [head]
    if "class" in labels:
        parts.append(labels["class"])
    if "le" in labels:
        bound = float(labels["le"])
        parts.append("+Inf" if math.isinf(bound) else repr(bound))
    return "|".join(parts)


async def _bounded_get(
    http: httpx.AsyncClient, url: str, params: Mapping[str, str] | None = None
) -> bytes:
    """GET `url`'s body, refusing more than MAX_METRICS_BYTES (a peer may be hostile)."""
    async with http.stream("GET", url, params=params) as response:
        response.raise_for_status()
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_METRICS_BYTES:
                raise ValueError(f"answer over {MAX_METRICS_BYTES} bytes")
    return bytes(body)


def merge(parts: Sequence[Mapping[str, Counters]]) -> dict[str, Counters]:
    out: dict[str, Counters] = {}
    for part in parts:
        for revision, counters in part.items():
            out[revision] = out[revision].plus(counters) if revision in out else counters
    return out


class GatewayFigures:
    """`reconcile.Figures` over the gateways' /metrics URLs; None when any cannot be read
    (a partial sum would understate one revision: the step waits instead)."""

    def __init__(self, urls: Sequence[str], timeout: float = 5.0) -> None:
        self.urls = list(urls)
        self.http = httpx.AsyncClient(timeout=timeout)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __call__(self, namespace: str, name: str, model: str) -> dict[str, Counters] | None:
        parts = []
        for url in self.urls:
            try:
                body = await _bounded_get(self.http, url)
                parts.append(parse(body.decode("utf-8", "replace"), model, namespace))
            except (httpx.HTTPError, ValueError) as error:
                log.warning("canary analysis: cannot read %s: %s", url, error)
                return None
        return merge(parts)


# What PrometheusFigures asks, per Counters field: (metric, whether to split by outcome).
PROMETHEUS_SERIES = (
    ("requests", metrics.GATEWAY_REVISION_REQUESTS, True),
    ("slo_met", metrics.GATEWAY_REVISION_SLO_MET, False),
    ("ttft_sum", f"{metrics.GATEWAY_REVISION_TTFT}_sum", False),
    ("ttft_count", f"{metrics.GATEWAY_REVISION_TTFT}_count", False),
    ("itl_sum", f"{metrics.GATEWAY_REVISION_ITL}_sum", False),
    ("itl_count", f"{metrics.GATEWAY_REVISION_ITL}_count", False),
)


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def prometheus_queries(namespace: str, model: str) -> dict[str, str]:
    """The PromQL of each Counters field: the gateways' counters summed over their replicas
    (the per-class series by class and bucket too)."""
    where = f'{{namespace="{_label_value(namespace)}",model="{_label_value(model)}"}}'
    queries = {
        key: f"sum by (revision{', outcome' if split else ''}) ({name}{where})"
        for key, name, split in PROMETHEUS_SERIES
    }
    for name in DETAIL_SERIES:
        queries[name] = f"sum by (revision, class, le) ({name}{where})"
    return queries


def from_prometheus(answers: Mapping[str, object]) -> dict[str, Counters]:
    """Counters per revision from the instant-query answers (`data.result` vectors) of
    `prometheus_queries`; ValueError for an answer that is not a vector."""
    fields: dict[str, dict[str, float]] = {}
    for key, answer in answers.items():
        data = answer.get("data") if isinstance(answer, Mapping) else None
        if not isinstance(data, Mapping) or data.get("resultType") != "vector":
            raise ValueError(f"Prometheus answered {key} with no vector")
        for item in data.get("result") or []:
            labels, value = item.get("metric") or {}, item.get("value") or [None, "nan"]
            revision = labels.get("revision")
            number = float(value[1])
            if not revision or number != number:  # no label, or NaN
                continue
            field = detail_key(key, labels) or key
            bucket = fields.setdefault(revision, {})
            bucket[field] = bucket.get(field, 0.0) + number
            if key == "requests" and labels.get("outcome") == "error":
                bucket["errors"] = bucket.get("errors", 0.0) + number
    return {revision: counters(values) for revision, values in fields.items()}


class PrometheusFigures:
    """`reconcile.Figures` from a Prometheus server that scrapes the gateways (every
    replica's counts, summed); None when it cannot be read."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.AsyncClient(timeout=timeout)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __call__(self, namespace: str, name: str, model: str) -> dict[str, Counters] | None:
        answers = {}
        try:
            for key, query in prometheus_queries(namespace, model).items():
                body = await _bounded_get(self.http, f"{self.url}/api/v1/query", {"query": query})
                answers[key] = json.loads(body)
            return from_prometheus(answers)
        except (httpx.HTTPError, ValueError, TypeError, IndexError, AttributeError) as error:
            log.warning("canary analysis: cannot query %s: %s", self.url, error)
            return None
