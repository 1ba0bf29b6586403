"""The gateway in the fleet simulation: production's admission pass on the simulated clock.

Each decision is production's own pass (`kubellm.gateway.routing.dispatch.admit_once`:
`saturated`, `decide`, `predicted_wait`, the profile's order from the shipped `Router`,
least-load, and `CompletionRate` on the simulated clock), with the gateway's default
settings (`SchedulerSettings`: the queue bound, the scale-from-zero wait; the pass's
look-again interval). The bench is not a component, so it may import the gateway.

What the simulation adds around it (fleet.py drives it):
- the loop of `admit`: a request the pass queues waits in the gateway's queue and passes
  again whenever a replica finishes a step that freed a slot, a fallback request ends, or
  half a second passes (production waits for a load-view change or 0.5 s);
- the fallback API's latency (`ApiModel`): a modelled TTFT and ITL, flags with
  documented defaults; a request served there meets the SLO when the wait in
  the gateway plus the API's TTFT meets the TTFT target and the API's ITL the
  ITL target.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kubellm import api
from kubellm.gateway.discovery.base import FallbackTarget, ModelTarget
from kubellm.gateway.routing.admission import CompletionRate, Route
from kubellm.gateway.routing.dispatch import WAKE_IN, Decision, Pass, admit_once
from kubellm.gateway.routing.replicas.load import LoadView
from kubellm.gateway.routing.replicas.outliers import OutlierDetector
from kubellm.gateway.routing.router import Router
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.settings import SchedulerSettings, Thresholds

__all__ = ["ApiModel", "Candidate", "CompletionRate", "Gateway", "Route"]

SETTINGS = SchedulerSettings()  # the gateway's defaults
# Without a fallback the simulation sends every request to a replica (it queues there):
# no replica counts as saturated.
NEVER_SATURATED = Thresholds(max_waiting=math.inf, max_kv_usage=math.inf, max_in_flight=None)


class Gateway:
    """One model's admission on the simulated clock: the shipped router (least-load) and
    pass, the fallback as the gateway sees it (None: every request to a replica)."""

    def __init__(self, slo: api.SLO, fallback: FallbackTarget | None, seed: int = 0) -> None:
        self.router = Router(LoadView(), OutlierDetector(), random.Random(seed))
        self.target = ModelTarget(
            "sim", "sim", routing=api.Routing(policy="least-load"), slo=slo, fallback=fallback
        )
        self.request = RoutingRequest("sim")  # the traces share no prefixes
        self.thresholds = SETTINGS.thresholds if fallback is not None else NEVER_SATURATED

    def admit(
        self,
        candidates: list[Candidate],
        now: float,
        deadline: float | None,
        queue: int,
        fallback_in_flight: int,
        rate: CompletionRate,
    ) -> tuple[Decision | None, float]:
        """One pass for a request (`deadline` None: it just arrived; else it is queued,
        `queue` the requests queued, itself included): the decision (None: it waits) and
        its deadline (the TTFT target, or the scale-from-zero wait with no replica)."""
        queued = deadline is not None
        if deadline is None:
            budget = (
                self.target.slo.ttft_seconds if candidates else SETTINGS.zero_replica_wait_seconds
            )
            deadline = now + budget
        p = Pass(
            self.target, self.request, now, deadline, bool(candidates), self.thresholds,
            rate=rate.rate,
        )  # fmt: skip
        p.refresh(
            self.target, candidates, now, self.target.fallback, fallback_in_flight,
            queue if queued else queue + 1, queued or queue < SETTINGS.max_queue,
        )  # fmt: skip
        return admit_once(p, (), self.router), deadline


RECHECK_SECONDS = WAKE_IN  # a queued request looks again at least this often


@dataclass(frozen=True)
class ApiModel:
    """The fallback API's latency and price per million tokens (input, output).

    Defaults: a hosted API serving a model of the same class (an 8B model):
    time to first token 0.6 s for a ~2,400-token prompt, 25 ms between
    tokens (40 tokens/s per stream), $0.20 per million tokens in and out.
    """

    ttft_seconds: float = 0.6
    itl_seconds: float = 0.025
    input_price_per_million: float = 0.20
    output_price_per_million: float = 0.20
    max_concurrency: int = 64  # spec.fallback.maxConcurrency's default

    def duration(self, output_tokens: int) -> float:
        return self.ttft_seconds + self.itl_seconds * max(0, output_tokens - 1)

    def cost(self, prompt_tokens: float, output_tokens: float) -> float:
        return (
            prompt_tokens * self.input_price_per_million
            + output_tokens * self.output_price_per_million
        ) / 1e6

    def target(self) -> FallbackTarget:
        """The gateway's view of the fallback: the production `FallbackTarget`."""
        return FallbackTarget(
            url="http://fallback.invalid/v1", max_concurrency=self.max_concurrency
        )
