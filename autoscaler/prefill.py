"""The prefill role's replicas (spec.prefill.autoscaling) and the pair's coordination: pure.

Prefill is compute-bound and its latency is the queue ahead of a prompt: a prefill replica
clears its queued prompt tokens at its prefill throughput, so the replicas needed are the
queued prefill work, in seconds of one replica, over the share of the TTFT budget it may
take (llm-d's token-aware recipe):

    replicas = ceil(queued_tokens / (tokens_per_second x targetQueueShare x slo.ttftSeconds))

with in-flight prompt tokens counted too (what the replicas hold now must also clear within
the budget), bounded by minReplicas/maxReplicas, and a lower ask held for the scale-down
window (the highest ask in the window wins, as the HorizontalPodAutoscaler's
stabilisation). The decode role keeps the kv-queue policy (KV occupancy, queue, ITL).

The pair scales to zero together: a prefill replica alone serves nothing (every request
needs a decode replica; the gateway prefills locally when the prefill role is empty), so
decode at zero means prefill at zero, and a decode role waking from zero brings the prefill
role back to its minimum in the same decision (`coordinate`).

Where the decisions land: the decode role through the LLMDeployment's /scale subresource
(spec.replicas, what HPA or KEDA also drive); the prefill role through a merge patch of
spec.prefill.replicas (a custom resource has one scale subresource; the operator derives the
prefill Deployment's replicas from it, zero while decode is zero).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kubellm import api


@dataclass(frozen=True)
class PrefillSignals:
    """The prefill role now: prompt tokens queued and being prefilled on its replicas, and
    one replica's prefill throughput (tokens/s: measured, else the profile's figure)."""

    queued_tokens: float
    running_tokens: float
    tokens_per_second: float
    current: int


def prefill_ask(signals: PrefillSignals, spec: api.PrefillAutoscaling, ttft_seconds: float) -> int:
    """Replicas that clear the queued and running prefill work within targetQueueShare of
    the TTFT budget, within [minReplicas, maxReplicas]. Without a throughput figure (no
    replica measured yet) the current count holds: unknown load never removes a replica."""
    if signals.tokens_per_second <= 0:
        ask = signals.current
    else:
        budget = signals.tokens_per_second * spec.target_queue_share * ttft_seconds
        work = max(0.0, signals.queued_tokens) + max(0.0, signals.running_tokens)
        ask = math.ceil(work / budget) if work > 0 else 0
    return max(spec.min_replicas, min(spec.max_replicas, ask))


def stabilised(asks: Sequence[tuple[float, int]], now: float, window: float, ask: int) -> int:
    """The highest of `ask` and the asks (time, replicas) within `window` seconds before
    `now`: a lower ask must hold for the whole window before replicas go."""
    recent = [n for t, n in asks if now - t <= window]
    return max([ask, *recent])


def coordinate(decode: int, prefill: int, prefill_min: int) -> tuple[int, int]:
    """The pair's replicas: prefill zero while decode is zero, and at least the prefill
    role's minimum once decode has a replica (waking from zero brings both)."""
    if decode <= 0:
        return 0, 0
    return decode, max(prefill, prefill_min)
