"""Reading load from Prometheus text: engine replicas and the gateway.

Parsing is pure (`engine_load`, `gateway_pending`: text in, numbers out);
`scrape` is the only I/O. A replica whose scrape fails, times out, or lacks
one of the metrics the policy needs is marked not fresh: its load is unknown,
and the policy never removes capacity on unknown load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import httpx
from kubellm.autoscaler.policy import ReplicaMetrics
from prometheus_client.parser import text_string_to_metric_families

from kubellm import bounded, metrics

log = logging.getLogger(__name__)

_NEEDED = (metrics.NUM_REQUESTS_WAITING, metrics.NUM_REQUESTS_RUNNING, metrics.KV_CACHE_USAGE)


class MetricsError(ValueError):
    """The text is not Prometheus exposition format, or lacks a needed metric."""


def _samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                yield sample.name, sample.labels, sample.value
    except ValueError as error:
        raise MetricsError(f"cannot parse Prometheus text: {error}") from None


def engine_load(text: str, name: str = "") -> ReplicaMetrics:
    """One engine's waiting, running and KV usage from its /metrics text.

    vLLM labels its gauges per engine core (`engine="0"`, ...) when one
    server runs several: queues add up, KV usage is averaged.
    """
    values: dict[str, list[float]] = {metric: [] for metric in _NEEDED}
    for sample, _, value in _samples(text):
        if sample in values:
            values[sample].append(value)
    missing = [metric for metric, found in values.items() if not found]
    if missing:
        raise MetricsError(f"metrics missing: {', '.join(missing)}")
    kv = values[metrics.KV_CACHE_USAGE]
    return ReplicaMetrics(
        name=name,
        fresh=True,
        waiting=sum(values[metrics.NUM_REQUESTS_WAITING]),
        running=sum(values[metrics.NUM_REQUESTS_RUNNING]),
        kv_cache_usage=sum(kv) / len(kv),
    )


def gateway_pending(text: str, model: str, deployment: str = "", namespace: str = "") -> float:
    """Requests the gateway holds for `model` (its served name); 0 when none are listed.

    Labels `deployment` and `namespace`, where present, must match too, so
    two deployments serving the same name in different namespaces stay apart.
    """
    return _gateway_sum(text, (metrics.GATEWAY_PENDING,), model, deployment, namespace)


def gateway_admitted(text: str, model: str, deployment: str = "", namespace: str = "") -> float:
    """Requests the gateway has admitted for `model` so far: answered (every route and
    code) plus pending. Its rate is the arrival rate (`kubellm.autoscaler.rate`)."""
    names = (metrics.GATEWAY_REQUESTS, metrics.GATEWAY_PENDING)
    return _gateway_sum(text, names, model, deployment, namespace)


def gateway_answered(
    text: str, model: str, route: str, deployment: str = "", namespace: str = ""
) -> float:
    """Requests the gateway answered for `model` by `route` (the counter's `target` label:
    replica, fallback or none), every code. The replicas' answers while every replica is
    saturated measure what one replica serves (the policy's derived rate)."""
    names = (metrics.GATEWAY_REQUESTS,)
    return _gateway_sum(text, names, model, deployment, namespace, route)


def gateway_fallback(text: str, model: str, deployment: str = "", namespace: str = "") -> float:
    """Requests the gateway has sent to the fallback API for `model` so far, every reason
    (counted when sent, so a fallback request counts while it is still streaming)."""
    return _gateway_sum(text, (metrics.GATEWAY_FALLBACK,), model, deployment, namespace)


def _gateway_sum(
    text: str,
    names: tuple[str, ...],
    model: str,
    deployment: str,
    namespace: str,
    route: str | None = None,
) -> float:
    total = 0.0
    for sample, labels, value in _samples(text):
        if sample not in names or labels.get("model") != model:
            continue
        if route is not None and labels.get("target") != route:
            continue
        if deployment and labels.get("deployment", deployment) != deployment:
            continue
        if namespace and labels.get("namespace", namespace) != namespace:
            continue
        total += value
    return total


MAX_ANSWER_BYTES = bounded.MAX_ANSWER_BYTES
AnswerTooLarge = bounded.AnswerTooLarge


async def fetch(client: httpx.AsyncClient, url: str, limit: int = MAX_ANSWER_BYTES) -> bytes | None:
    """GET `url`'s body: whole within the client's read timeout, taken as a deadline for the
    entire answer (a replica trickling bytes is cut off), and at most `limit` bytes (the
    core's bounded reader: chunks, never buffered past it); None (logged) on any failure."""
    seconds = client.timeout.read or 10.0
    try:
        async with asyncio.timeout(seconds), client.stream("GET", url) as response:
            response.raise_for_status()
            length = response.headers.get("content-length", "")
            declared = int(length) if length.isdigit() else None
            return await bounded.read_capped(response.aiter_bytes(), limit, declared)
    except (httpx.HTTPError, TimeoutError, AnswerTooLarge) as error:
        log.info("GET %s failed: %s", url, error or type(error).__name__)
        return None


async def scrape(client: httpx.AsyncClient, url: str) -> str | None:
    """GET a /metrics URL; None (logged) on any failure, so callers mark it stale."""
    body = await fetch(client, url)
    return None if body is None else body.decode("utf-8", "replace")


def replica_metrics(name: str, url: str, text: str | None) -> ReplicaMetrics:
    """One engine's load from its scraped text (None: the scrape failed); a replica with
    unknown load (fresh=False) when the text is missing or unusable."""
    if text is None:
        return ReplicaMetrics(name=name, fresh=False)
    try:
        return engine_load(text, name)
    except MetricsError as error:
        log.info("metrics of %s at %s unusable: %s", name, url, error)
        return ReplicaMetrics(name=name, fresh=False)


def fold_ranks(ranks: Iterable[ReplicaMetrics]) -> tuple[ReplicaMetrics, ...]:
    """One ReplicaMetrics per replica from per-endpoint ones: the data-parallel ranks of a
    replica (endpoints sharing its name) add their waiting and running requests and average
    their KV-cache usage (each rank holds its own pool, all of one size); the replica's load
    is unknown when any rank's is. Replicas keep their first rank's order. Pure."""
    groups: dict[str, list[ReplicaMetrics]] = {}
    for rank in ranks:
        groups.setdefault(rank.name, []).append(rank)
    out = []
    for name, members in groups.items():
        if len(members) == 1:
            out.append(members[0])
        elif not all(m.fresh for m in members):
            out.append(ReplicaMetrics(name=name, fresh=False))
        else:
            out.append(ReplicaMetrics(
                name=name, fresh=True,
                waiting=sum(m.waiting for m in members),
                running=sum(m.running for m in members),
                kv_cache_usage=sum(m.kv_cache_usage for m in members) / len(members),
            ))  # fmt: skip
    return tuple(out)


async def replica(client: httpx.AsyncClient, name: str, url: str) -> ReplicaMetrics:
    """Scrape one engine; a replica with unknown load (fresh=False) on any failure."""
    return replica_metrics(name, url, await scrape(client, url))
