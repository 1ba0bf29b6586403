"""The prefill role's period in the control loop (spec.prefill.autoscaling): scrape its
replicas, decide (`prefill.decide`, pure), write spec.prefill.replicas and
status.autoscaler.prefill. The decode role is decided first, in the same period: the
pair's coordination reads its count."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kubellm.autoscaler import prefill
from kubellm.autoscaler.backend import Backend, Target
from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics

REQUESTS_FINISHED = "vllm:request_success_total"
_READ = {
    metrics.NUM_REQUESTS_WAITING: "waiting",
    metrics.NUM_REQUESTS_RUNNING: "running",
    metrics.PROMPT_TOKENS: "prompt_tokens",
    REQUESTS_FINISHED: "requests",
}


def prefill_load(text: str | None) -> dict[str, float] | None:
    """A prefill replica's requests waiting and running, and its cumulative prompt tokens
    and finished requests; None when the scrape failed or lacks one of them."""
    if text is None:
        return None
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = _READ.get(sample.name)
                if key is not None:
                    found[key] = found.get(key, 0.0) + sample.value
    except ValueError:
        return None
    return found if len(found) == len(_READ) else None


async def tend(
    backend: Backend,
    scrape: Callable[[str], Awaitable[str | None]],
    target: Target,
    decode_replicas: int,
    now: float,
) -> prefill.PrefillDecision:
    """One period of the prefill role of `target` (its decode role at `decode_replicas`)."""
    assert target.prefill is not None
    endpoints = [e for e in await backend.prefill_endpoints(target) if e.ready]
    loads = [prefill_load(t) for t in await asyncio.gather(*(scrape(e.metrics_url)
                                                              for e in endpoints))]  # fmt: skip
    good = [load for load in loads if load is not None]
    total = {key: sum(load[key] for load in good) for key in _READ.values()}
    seen = prefill.PrefillObservation(
        now=now, current=target.prefill_replicas, decode_replicas=decode_replicas,
        ready=len(good), fresh=len(good) == len(loads), **total,
    )  # fmt: skip
    status = target.status.get("prefill") or {}
    decision = prefill.decide(seen, status, target.prefill, target.ttft_seconds)
    if decision.replicas != target.prefill_replicas:
        await backend.write_prefill_replicas(target, decision.replicas)
        await backend.record_event(target, decision.reason, decision.message)
    if decision.status != status:
        await backend.write_status(target, {"prefill": decision.status})
    return decision
