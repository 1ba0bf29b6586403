"""The routing state of one gateway process, around the pure picker.

Holds what scorers read (prefix index, session table, load view, outlier
record) and turns a model's endpoints into ordered candidates: health filters
first (not draining, not ejected), then the policy's filters and scorers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from kubellm.gateway.discovery.base import ModelTarget
from kubellm.gateway.load import LoadView
from kubellm.gateway.outliers import OutlierDetector
from kubellm.gateway.scorers import prefix
from kubellm.gateway.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.scorers.picker import pick, profiles
from kubellm.gateway.scorers.session import SessionTable


def routing_request(model: str, body: dict[str, Any], session: str | None) -> RoutingRequest:
    """The routing features of a request body: prompt chunk-hash chain, home key, session."""
    text = prefix.prompt_text(body)
    hashes = prefix.chunk_hashes(text)
    user = body.get("user")
    return RoutingRequest(
        model=model,
        chunk_hashes=hashes,
        affinity_key=prefix.affinity_key(text, hashes),
        session=session or (user if isinstance(user, str) and user else None),
    )


class Router:
    def __init__(
        self,
        load: LoadView,
        outliers: OutlierDetector,
        rng: random.Random | None = None,
        index_capacity: int = 65_536,
    ) -> None:
        self.load = load
        self.outliers = outliers
        self.rng = rng or random.Random()
        self.index = prefix.PrefixIndex(index_capacity)
        self.sessions = SessionTable()
        self.profiles = profiles(self.index, self.sessions)

    def candidates(self, target: ModelTarget) -> list[Candidate]:
        """Endpoints that may take a new request: routable and not ejected."""
        out = []
        for endpoint in target.routable:
            if self.outliers.ejected(endpoint.url):
                continue
            stats = self.load.stats(endpoint.url)
            out.append(
                Candidate(
                    url=endpoint.url,
                    load=self.load.load(endpoint.url),
                    in_flight=self.load.in_flight.get(endpoint.url, 0),
                    waiting=None if stats is None else stats.waiting,
                    kv_usage=None if stats is None else stats.kv_usage,
                )
            )
        return out

    def order(
        self, target: ModelTarget, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> list[Candidate]:
        profile = self.profiles[target.routing.policy]
        return pick(profile, request, candidates, target.routing.load_bound, self.rng)

    def routed(self, request: RoutingRequest, url: str) -> float:
        """Remember where a request went; returns the prefix match ratio it had there."""
        total = len(request.chunk_hashes)
        ratio = self.index.matched(url, request.chunk_hashes) / total if total else 0.0
        self.index.record(url, request.chunk_hashes)
        if request.session:
            self.sessions.record(request.session, url)
        return ratio
