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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubellm import api

# Recommendations kept for the scale-down window at most (as status.autoscaler's)
MAX_SAMPLES = api.MAX_STATUS_SAMPLES


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


@dataclass(frozen=True)
class PrefillObservation:
    """The prefill role in one control period: its ready replicas' requests (every request
    there is a prompt: a prefill leg asks for one token) and their cumulative prompt tokens
    and finished requests (vLLM's counters), and the decode role's replicas as decided now."""

    now: float
    current: int  # spec.prefill.replicas now
    decode_replicas: int
    ready: int  # ready prefill replicas, every one scraped
    fresh: bool  # every ready replica's scrape worked
    waiting: float = 0.0
    running: float = 0.0
    prompt_tokens: float = 0.0  # vllm:prompt_tokens_total, summed
    requests: float = 0.0  # vllm:request_success_total, summed


@dataclass(frozen=True)
class PrefillDecision:
    replicas: int
    reason: str
    message: str
    status: dict[str, Any]  # status.autoscaler.prefill, camelCase


# A throughput measured over a period blends into the learned one with this weight.
LEARN_WEIGHT = 0.5


def learn_throughput(seen: PrefillObservation, status: Mapping[str, Any]) -> float | None:
    """One prefill replica's prompt tokens/s: learned from the periods in which every ready
    replica had a queue at both ends (a saturated replica computes at its throughput), else
    the figure learned before (None: never saturated yet)."""
    learned = status.get("tokensPerSecond")
    before, since = status.get("promptTokens"), status.get("sampleTime")
    saturated = seen.ready > 0 and seen.waiting >= seen.ready
    if not (saturated and status.get("saturated") and status.get("ready") == seen.ready):
        return learned
    if before is None or since is None or seen.now <= since or seen.prompt_tokens < before:
        return learned  # a restarted replica's counters went back: no figure this period
    measured = (seen.prompt_tokens - before) / (seen.now - since) / seen.ready
    if measured <= 0:
        return learned
    return measured if learned is None else LEARN_WEIGHT * measured + (1 - LEARN_WEIGHT) * learned


def decide(
    seen: PrefillObservation,
    status: Mapping[str, Any],
    spec: api.PrefillAutoscaling,
    ttft_seconds: float,
) -> PrefillDecision:
    """The prefill role's replicas this period: the queued and running prompt tokens (the
    requests there times the mean prompt) against the TTFT budget (`prefill_ask`), the
    highest ask of the scale-down window, and the pair's coordination (`coordinate`).
    A period with a failed scrape never lowers the count."""
    tps = learn_throughput(seen, status)
    mean_prompt = seen.prompt_tokens / seen.requests if seen.requests > 0 else 0.0
    signals = PrefillSignals(
        seen.waiting * mean_prompt, seen.running * mean_prompt, tps or 0.0, seen.current
    )
    ask = prefill_ask(signals, spec, ttft_seconds)
    if not seen.fresh:
        ask = max(ask, seen.current)
    window = spec.scale_down_stabilization_seconds
    past = [(float(r["time"]), int(r["replicas"])) for r in status.get("recommendations") or []]
    held = stabilised(past, seen.now, window, ask)
    _, replicas = coordinate(seen.decode_replicas, held, spec.min_replicas)
    work = (signals.queued_tokens + signals.running_tokens) / tps if tps else None
    if seen.decode_replicas <= 0:
        reason, why = "PairAtZero", "the decode role is at zero"
    elif tps is None:
        reason, why = "NoThroughputYet", "no prefill throughput learned yet (never saturated)"
    elif held > ask:
        reason, why = "ScaleDownHeld", f"a higher ask within the last {window} s holds"
    else:
        reason, why = (
            "QueuedPrefillWork",
            (
                f"{work:.2f} s of queued prefill work at {tps:.0f} tokens/s per replica against "
                f"{spec.target_queue_share:g} x TTFT {ttft_seconds:g} s"
            ),
        )
    message = f"prefill {seen.current} -> {replicas} replicas; {why}"
    kept = [{"time": t, "replicas": n} for t, n in past if seen.now - t <= window]
    return PrefillDecision(
        replicas, reason, message,
        {
            "desiredReplicas": replicas, "reason": reason, "message": message,
            "tokensPerSecond": None if tps is None else round(tps, 3),
            "queuedSeconds": None if work is None else round(work, 4),
            "promptTokens": seen.prompt_tokens, "sampleTime": seen.now, "ready": seen.ready,
            "saturated": seen.ready > 0 and seen.waiting >= seen.ready,
            "recommendations": [*kept, {"time": seen.now, "replicas": ask}][-MAX_SAMPLES:],
        },
    )  # fmt: skip
