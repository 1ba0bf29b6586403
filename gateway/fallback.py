"""Admission: for each request, before any byte is sent, decide where it goes.

`decide` is a pure function of what the gateway sees for one model:

- a replica that is not saturated is ready            -> REPLICA
- no ready replica, fallback has the trigger and room -> FALLBACK
- every replica saturated, same                       -> FALLBACK
- otherwise, while the queue has room and the request's
  wait budget (its TTFT target, or the scale-from-zero
  wait when no replica exists) is not spent            -> QUEUE
- otherwise                                            -> REJECT (429, Retry-After)

A replica is saturated when its engine reports a queue of at least
`max_waiting` or KV-cache usage of at least `max_kv_usage` (fresh metrics
only), or the gateway already has `max_in_flight` requests on it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kubellm.gateway.discovery.base import FallbackTarget
from kubellm.gateway.scorers.base import Candidate


class Route(enum.Enum):
    REPLICA = "replica"
    FALLBACK = "fallback"
    QUEUE = "queue"
    REJECT = "reject"


@dataclass(frozen=True)
class Thresholds:
    max_waiting: float = 8.0
    max_kv_usage: float = 0.95
    max_in_flight: int | None = None


@dataclass(frozen=True)
class Decision:
    route: Route
    reason: str


def saturated(candidate: Candidate, thresholds: Thresholds) -> bool:
    if candidate.waiting is not None and candidate.waiting >= thresholds.max_waiting:
        return True
    if candidate.kv_usage is not None and candidate.kv_usage >= thresholds.max_kv_usage:
        return True
    return thresholds.max_in_flight is not None and candidate.in_flight >= thresholds.max_in_flight


def decide(
    ready: int,
    unsaturated: int,
    fallback: FallbackTarget | None,
    fallback_in_flight: int,
    may_wait: bool,
) -> Decision:
    """Where one request goes now. `may_wait`: queue has room and the wait budget is left."""
    if unsaturated > 0:
        return Decision(Route.REPLICA, "ready")
    trigger = "no-ready-replicas" if ready == 0 else "saturated"
    if (
        fallback is not None
        and trigger in fallback.triggers
        and fallback_in_flight < fallback.max_concurrency
    ):
        return Decision(Route.FALLBACK, trigger)
    if may_wait:
        return Decision(Route.QUEUE, trigger)
    return Decision(Route.REJECT, trigger)
