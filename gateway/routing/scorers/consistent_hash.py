"""Consistent home replica: rendezvous (highest-random-weight) hashing of the prefix key.

Score 1 for the candidate with the highest H(key, url), 0 for the others.
It depends only on the prompt and the candidate set, so every gateway replica
sends a prefix to the same engine without sharing state; when the bounded-load
filter removes the home, the next in rendezvous order wins, again the same on
every gateway. This is what keeps hit rates up with several gateways.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest


def rendezvous_weight(key: int, url: str) -> int:
    digest = hashlib.blake2b(key.to_bytes(8, "big") + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class ConsistentHashScorer:
    name = "consistent-hash"
    stateless = True  # its score is a pure function of the request and candidates

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        if request.affinity_key is None or not candidates:
            return [0.0] * len(candidates)
        weights = [rendezvous_weight(request.affinity_key, c.url) for c in candidates]
        best = max(weights)
        return [1.0 if w == best else 0.0 for w in weights]
