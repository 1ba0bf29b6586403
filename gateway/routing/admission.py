"""Admission: for each request, before any byte is sent, decide where it goes.

`decide` is a pure function of what the gateway sees for one model:

- a replica that is not saturated is ready            -> REPLICA
  (slo-aware: unless the best predicted TTFT there
  is past the remaining budget and the fallback has
  room                                                 -> FALLBACK "predicted-ttft")
- every replica saturated, but the predicted wait for
  a slot fits the request's remaining TTFT budget      -> QUEUE ("short-wait")
- no ready replica, fallback has the trigger and room -> FALLBACK
- every replica saturated, same                       -> FALLBACK
- otherwise, while the queue has room and the request's
  wait budget (its TTFT target, or the scale-from-zero
  wait when no replica exists) is not spent            -> QUEUE
- otherwise                                            -> REJECT (429, Retry-After)

A replica is saturated when its engine reports a queue of at least
`max_waiting` or KV-cache usage of at least `max_kv_usage` (fresh metrics
only), or the gateway already has `max_in_flight` requests on it.

The predicted wait is the request's place in the model's queue divided by the
rate at which its replicas finished requests over the last seconds
(`CompletionRate`): a saturated fleet that frees a slot every 50 ms serves
the fifth request in line within a 0.5 s TTFT target, which is cheaper than
the external API; one that frees a slot every few seconds does not, so the
request goes to the fallback at once instead of spending its budget waiting.
With no completions seen, the wait is unbounded: the fallback (or the queue,
without one) decides as before.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

from kubellm.gateway.discovery.base import FallbackTarget
from kubellm.gateway.routing.scorers.base import Candidate
from kubellm.gateway.routing.settings import Thresholds

__all__ = ["CompletionRate", "Decision", "Route", "Thresholds", "decide", "saturated"]


class Route(enum.Enum):
    REPLICA = "replica"
    FALLBACK = "fallback"
    QUEUE = "queue"
    REJECT = "reject"


class Decision(NamedTuple):
    """(A tuple, not a frozen dataclass: one is built on every pass.)"""

    route: Route
    reason: str


def saturated(candidate: Candidate, thresholds: Thresholds) -> bool:
    if candidate.waiting is not None and candidate.waiting >= thresholds.max_waiting:
        return True
    if candidate.kv_usage is not None and candidate.kv_usage >= thresholds.max_kv_usage:
        return True
    return thresholds.max_in_flight is not None and candidate.in_flight >= thresholds.max_in_flight


class CompletionRate:
    """Requests finished per second on each endpoint, over a sliding window."""

    def __init__(self, window: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.clock = clock
        self._done: dict[str, deque[float]] = {}

    def record(self, url: str) -> None:
        now = self.clock()
        times = self._done.setdefault(url, deque())
        times.append(now)
        while times[0] < now - self.window:  # bounded by the window, read or not
            times.popleft()

    def rate(self, urls: Iterable[str]) -> float:
        """Completions per second summed over `urls` (0 when none finished in the window)."""
        since = self.clock() - self.window
        total = 0
        for url in urls:
            times = self._done.get(url)
            if not times:
                continue
            while times and times[0] < since:
                times.popleft()
            total += len(times)
        return total / self.window


class FallbackSlots(dict[str, int]):
    """The fallback API's requests in flight per model (the table's `fallback_in_flight`,
    bounded by `fallback.max_concurrency`); `hold` takes one."""

    def __init__(self, on_free: Callable[[], None]) -> None:
        super().__init__()
        self.on_free = on_free

    def hold(self, model: str) -> Callable[[], None]:
        """Hold one of `model`'s slots; the callback frees it (once), then `on_free`."""
        self[model] = self.get(model, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self[model] -= 1
                self.on_free()

        return release


def predicted_wait(position: int, completions_per_second: float) -> float:
    """Seconds until the `position`-th queued request gets a slot (inf: no completions seen)."""
    if completions_per_second <= 0:
        return math.inf
    return position / completions_per_second


def decide(
    ready: int,
    unsaturated: int,
    fallback: FallbackTarget | None,
    fallback_in_flight: int,
    may_wait: bool,
    wait: float = math.inf,
    budget_left: float = 0.0,
    predicted_ttft: float | None = None,
) -> Decision:
    """Where one request goes now. `may_wait`: queue has room and the wait budget is left;
    `wait`: the predicted wait for a replica slot; `budget_left`: TTFT budget still unspent;
    `predicted_ttft`: the best replica's predicted TTFT (slo-aware; None: not predicted).
    The saturation thresholds stay the safety bound: a replica past them is never `ready`."""
    if unsaturated > 0:
        late = predicted_ttft is not None and predicted_ttft > budget_left
        if (
            late
            and fallback is not None
            and "saturated" in fallback.triggers
            and fallback_in_flight < fallback.max_concurrency
        ):
            return Decision(Route.FALLBACK, "predicted-ttft")
        return Decision(Route.REPLICA, "ready")
    trigger = "no-ready-replicas" if ready == 0 else "saturated"
    if ready > 0 and may_wait and wait <= budget_left:
        return Decision(Route.QUEUE, "short-wait")
    if (
        fallback is not None
        and trigger in fallback.triggers
        and fallback_in_flight < fallback.max_concurrency
    ):
        return Decision(Route.FALLBACK, trigger)
    if may_wait:
        return Decision(Route.QUEUE, trigger)
    return Decision(Route.REJECT, trigger)
