"""Queue depth: fewer waiting requests on the engine is better. Score = 1 / (1 + waiting).

Stale or missing engine metrics score 0.5: unknown, neither preferred nor avoided.
"""

from __future__ import annotations

from collections.abc import Sequence

from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest


class QueueScorer:
    name = "queue"
    stateless = True  # its score is a pure function of the request and candidates

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [0.5 if c.waiting is None else 1.0 / (1.0 + c.waiting) for c in candidates]
