"""Load: requests on the endpoint (the larger of the gateway's count and the engine's).

Score = 1 - load / max load over the candidates (1 for all when none is loaded).
"""

from __future__ import annotations

from collections.abc import Sequence

from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest


class InFlightScorer:
    name = "in-flight"
    stateless = True  # its score is a pure function of the request and candidates

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        top = max((c.load for c in candidates), default=0.0)
        if top <= 0:
            return [1.0] * len(candidates)
        return [1.0 - c.load / top for c in candidates]
