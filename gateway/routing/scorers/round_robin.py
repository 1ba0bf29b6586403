"""Round-robin: score 1 for the next candidate in turn, 0 for the others (per model)."""

from __future__ import annotations

from collections.abc import Sequence

from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest


class RoundRobinScorer:
    name = "round-robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        if not candidates:
            return []
        turn = self._next.get(request.model, 0)
        self._next[request.model] = turn + 1
        ordered = sorted(range(len(candidates)), key=lambda i: candidates[i].url)
        chosen = ordered[turn % len(candidates)]
        return [1.0 if i == chosen else 0.0 for i in range(len(candidates))]
