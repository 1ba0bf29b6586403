"""The canary analysis' figures: the gateway's per-revision counters of one model.

`parse` is pure (Prometheus text in, cumulative `Counters` per revision out);
`GatewayFigures` reads one or more gateways' `/metrics` (each gateway replica counts
what it routed, so their counters add up) with a timeout and a bound on the answer.
"""

from __future__ import annotations

import logging
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
            if sample.name == metrics.GATEWAY_REVISION_REQUESTS:
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
    return {revision: Counters(**values) for revision, values in fields.items()}


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
                async with self.http.stream("GET", url) as response:
                    response.raise_for_status()
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > MAX_METRICS_BYTES:
                            raise ValueError(f"answer over {MAX_METRICS_BYTES} bytes")
                parts.append(parse(body.decode("utf-8", "replace"), model, namespace))
            except (httpx.HTTPError, ValueError) as error:
                log.warning("canary analysis: cannot read %s: %s", url, error)
                return None
        return merge(parts)
