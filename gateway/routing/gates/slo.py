"""The SLO gate: the latency model's prediction in the pass, and its feedback.

For a model routed `slo-aware`, the pass predicts the lowest TTFT among the open replicas
(`predicted.Predictions.costs`); `admission.decide` sends the request to the fallback when
that is past the TTFT budget left and the fallback has room ("predicted-ttft").

Every policy's answers teach the model (`routing/latency/predictions.py`, `latency/model.py`):
through the ticket, an attempt sent is the replica's state at dispatch (`sent`), its first
token the prefill it took (`first_token`), and a whole streamed 200 answer from the replica
it was sent to the prediction's error (`over` with `learn`: TTFT from the dispatch, not
the arrival, since admission's wait is not the replica's); an attempt that ends before its
first token gives back the prefill it was charged (`abandoned`). Every SPEED_EVERY answers
the model's speed factors are published.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kubellm.gateway.discovery.base import ModelTarget
from kubellm.gateway.routing.dispatch import Gate, Pass
from kubellm.gateway.routing.latency.predictions import Predictions
from kubellm.gateway.routing.scorers.base import Candidate

if TYPE_CHECKING:
    from kubellm.gateway.routing.lifecycle import Ticket

# How often (answers) the replicas' speed factors are recomputed for /metrics.
SPEED_EVERY = 16


class SloGate(Gate):
    def __init__(
        self,
        predictions: Predictions,
        labels: Callable[[ModelTarget], tuple[str, str, str]],
        in_flight: Callable[[str], int] = lambda url: 0,
    ) -> None:
        self.predictions = predictions
        self.labels = labels
        self.in_flight = in_flight  # this front end's requests on a replica
        self.answers = 0

    def narrow(self, p: Pass) -> None:
        if p.open and p.target.routing.policy == "slo-aware":
            slo, predictions = p.target.slo, self.predictions
            cached = predictions.tiered(p.target, p.routing)
            costs = predictions.costs(p.routing, p.open, slo.ttft_seconds, slo.itl_seconds, cached)
            p.predicted = min(ttft for _, ttft, _ in costs.values())

    def sent(self, ticket: Ticket, url: str) -> None:
        for candidate in ticket.order:  # (a loop: no generator built per attempt)
            if candidate.url == url:
                break
        else:  # a replica the front end chose itself
            candidate = Candidate(url, 0.0, self.in_flight(url))
        cached = self.predictions.tiered(ticket.target, ticket.routing)
        dispatch = self.predictions.sent(
            url, ticket.routing, candidate, None if cached is None else cached.get(url)
        )
        ticket.dispatch = [url, dispatch, self.predictions.clock(), False, None]

    def first_token(self, ticket: Ticket, now: float) -> None:
        dispatch = ticket.dispatch  # (url, its Dispatch, when sent, started, learnt)
        if dispatch is not None and not dispatch[3]:
            dispatch[3] = True  # its prefill is done; what it taught the model, taken back
            dispatch[4] = self.predictions.started(dispatch[0], dispatch[1], now - dispatch[2])

    def over(self, ticket: Ticket, learn: bool = False) -> None:
        dispatch, ticket.dispatch = ticket.dispatch, None
        if dispatch is None:
            return
        if not dispatch[3]:
            self.predictions.abandoned(dispatch[0], dispatch[1])
            return
        timing = ticket.timing
        if learn and ticket.stream and timing.first is not None and dispatch[0] == ticket.served:
            self.answered(
                ticket.target, dispatch[0], dispatch[1], timing.first - dispatch[2],
                timing.mean_itl, timing.chunks,
            )  # fmt: skip

    def answered(
        self,
        target: ModelTarget,
        url: str,
        dispatch: object,
        ttft: float,
        itl: float | None,
        tokens: int | None = None,
    ) -> None:
        """A whole streamed answer of `url` (`tokens` events carrying text): the
        prediction's error, and the model learns; every SPEED_EVERY answers the model's
        speed factors are published."""
        names = self.labels(target)
        self.predictions.answered(names, url, dispatch, ttft, itl, tokens)  # type: ignore[arg-type]
        self.answers += 1
        if self.answers % SPEED_EVERY == 0:
            self.predictions.publish_speed(names, [e.url for e in target.endpoints])
