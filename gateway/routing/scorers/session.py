"""Session affinity: a request with a session key prefers the endpoint its session used last.

Score 1 for that endpoint, 0 elsewhere. The table is a bounded LRU of
session -> endpoint URL. The bounded-load filter runs first, so a session
never pins a request to an overloaded replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest


class SessionTable:
    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._last: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str) -> str | None:
        return self._last.get(session)

    def record(self, session: str, url: str) -> None:
        self._last[session] = url
        self._last.move_to_end(session)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)


class SessionScorer:
    name = "session"
    stateless = True  # its score is a pure function of the request and candidates

    def __init__(self, table: SessionTable) -> None:
        self.table = table

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        last = self.table.get(request.session) if request.session else None
        return [1.0 if last is not None and c.url == last else 0.0 for c in candidates]
