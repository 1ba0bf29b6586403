"""KV-cache usage: an engine with free KV blocks admits new sequences. Score = 1 - usage.

Stale or missing engine metrics score 0.5.
"""

from __future__ import annotations

from collections.abc import Sequence

from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest


class KVCacheScorer:
    name = "kv-cache"
    stateless = True  # its score is a pure function of the request and candidates

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [0.5 if c.kv_usage is None else max(0.0, 1.0 - c.kv_usage) for c in candidates]
