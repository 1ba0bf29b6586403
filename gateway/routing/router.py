"""The routing state of one gateway process, around the pure picker.

Holds what scorers read (prefix index, session table, load view, outlier
record) and turns a model's endpoints into ordered candidates: health filters
first (not draining, not ejected), then the request's profile (`routing/profiles.py`,
where each policy's filters and weighted scorers are declared).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kubellm.gateway.discovery.base import Endpoint, ModelTarget
from kubellm.gateway.routing.index.precise_routing import PreciseRouting
from kubellm.gateway.routing.latency.metrics import GatewayMetrics, labels
from kubellm.gateway.routing.latency.predictions import Predictions
from kubellm.gateway.routing.profiles import HOLDER_SHARE, HOLDER_SLACK, Profiles, Shared
from kubellm.gateway.routing.replicas.adapters import AdapterScorer
from kubellm.gateway.routing.replicas.load import LoadView
from kubellm.gateway.routing.replicas.outliers import OutlierDetector
from kubellm.gateway.routing.scorers import prefix
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.scorers.consistent_hash import rendezvous_weight
from kubellm.gateway.routing.scorers.session import SessionTable
from prometheus_client import CollectorRegistry

__all__ = ["HOLDER_SHARE", "HOLDER_SLACK", "Router", "home", "routing_request"]


def routing_request(
    model: str, body: dict[str, Any], session: str | None, adapter: str | None = None
) -> RoutingRequest:
    """The routing features of a request body: prompt chunk-hash chain, home key, session,
    LoRA adapter. With an adapter the chain starts from its name: vLLM keys cached KV
    blocks by adapter too, so a prefix computed under one adapter is no hit under another."""
    text = prefix.prompt_text(body)
    if adapter is not None:
        text = f"<|lora:{adapter}|>{text}"
    hashes = prefix.chunk_hashes(text)
    if not session:
        user = body.get("user")
        session = user if isinstance(user, str) and user else None
    # positional, in field order (model, chunk_hashes, affinity_key, session, adapter,
    # kv_hashes, body, prompt_chars): a tuple's keyword arguments cost as much again
    return RoutingRequest(
        model, hashes, prefix.affinity_key(text, hashes), session, adapter, (), body, len(text)
    )


class Router:
    def __init__(
        self,
        load: LoadView,
        outliers: OutlierDetector,
        rng: random.Random | None = None,
        index_capacity: int = 65_536,
        precise: PreciseRouting | None = None,
        registry: CollectorRegistry | None = None,
        presume_home: bool = False,
    ) -> None:
        """`presume_home`: other front ends share this model's traffic, so a prompt this
        one knows no holder of is presumed held at its home (profiles._Prefix)."""
        self.load = load
        self.outliers = outliers
        self.rng = rng or random.Random()
        self.index = prefix.PrefixIndex(index_capacity)
        self.sessions = SessionTable()
        self.sharing = prefix.Sharing()
        self.precise = precise
        # slo-aware's latency model (learnt under every policy: routing/latency/predictions.py)
        self.predictions = Predictions(registry=registry)
        self.predictions.precise = precise  # its tiered match, where a model routes by it
        self.shared = Shared(
            self.index, self.sessions, precise, predictions=self.predictions,
            sharing=self.sharing if presume_home else None,
        )  # fmt: skip
        self.profiles = Profiles(self.shared, self.unshared)

    @property
    def adapter_scorer(self) -> AdapterScorer | None:
        """LoRA affinity's view of the adapters (None: adapter-blind routing)."""
        return self.shared.adapters

    @adapter_scorer.setter
    def adapter_scorer(self, scorer: AdapterScorer | None) -> None:
        self.shared.adapters = scorer

    def candidates(
        self,
        target: ModelTarget,
        endpoints: Sequence[Endpoint] | None = None,
        panic: bool = False,
    ) -> list[Candidate]:
        """Endpoints that may take a new request: routable (or `endpoints`: a prefill
        leg's), not ejected, and not down (the latest scrape failed), unless every one that
        is not ejected is down: then those, since an engine without working metrics may
        still answer. `panic`: when every one is ejected, all of them (as Envoy's panic
        threshold: an ejected replica may answer, a model with none answers nothing)."""
        given = target.routable if endpoints is None else endpoints
        alive = [e for e in given if not self.outliers.ejected(e.url)]
        if panic and not alive:
            alive = list(given)
        load = self.load
        healthy = [e for e in alive if not load.down(e.url)]
        out = []
        for endpoint in healthy or alive:
            url = endpoint.url
            stats = load.stats(url)  # read once (`LoadView.load` would read them again)
            in_flight = load.in_flight.get(url, 0)
            weight = load.load_of(url, in_flight, stats)
            # positional, in field order: a tuple's keyword arguments cost as much again
            if stats is None:
                out.append(Candidate(url, weight, in_flight))
            else:
                out.append(
                    Candidate(url, weight, in_flight, stats.waiting, stats.kv_usage, stats.running)
                )
        return out

    def order(
        self, target: ModelTarget, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> list[Candidate]:
        """The candidates best first for `request`: its profile's (`routing/profiles.py`,
        the one place that answers which replica gets a request). A canary rollout's split
        narrows the candidates first (the `revision` filter): the other revision's
        replicas are not even a last resort."""
        return self.profiles.order(target, request, candidates, self.rng)

    def narrow(
        self, target: ModelTarget, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> list[Candidate]:
        """`candidates` narrowed as `order` narrows them first (the revision filter)."""
        return list(self.profiles.narrow(target, request, candidates))

    def unshared(self, request: RoutingRequest) -> bool:
        """A cold prompt (this gateway never routed its first chunk) of a model whose
        recent traffic shares almost no prefixes: load decides, not the prompt's home."""
        hashes = request.chunk_hashes
        return self.sharing.low(request.model) and not (hashes and self.sharing.seen(hashes[0]))

    def cached_share(self, request: RoutingRequest, url: str) -> float:
        """The share of the request's prompt blocks the index believes `url` holds."""
        hashes = request.chunk_hashes
        return self.index.matched(url, hashes) / len(hashes) if hashes else 0.0

    def routed(
        self,
        request: RoutingRequest,
        url: str,
        candidates: Sequence[str] | Callable[[], Sequence[str]],
    ) -> float:
        """Remember where a request went; returns the prefix match ratio it had there.
        `candidates`: the URLs it was ordered among, or what builds them (only a cold
        prompt's home needs them: most requests never build the list).

        A cold prompt that went elsewhere than its home (the home was past the load
        bound, or load decided) is not indexed there: this gateway would otherwise
        keep sending its prefix to a replica other gateways know nothing of. Its
        next request goes home, or to the same next replica every gateway picks.
        """
        hashes = request.chunk_hashes
        ratio = self.cached_share(request, url)
        cold = bool(hashes) and not self.sharing.observe(request.model, hashes[0])
        if not cold or url == home(request, candidates() if callable(candidates) else candidates):
            self.index.record(url, hashes)
        if request.session:
            self.sessions.record(request.session, url)
        return ratio

    def state(self, endpoint: Endpoint) -> str:
        """ready, draining, ejected (failures) or down (its latest scrape failed)."""
        if endpoint.draining:
            return "draining"
        if self.outliers.ejected(endpoint.url):
            return "ejected"
        return "down" if self.load.down(endpoint.url) else "ready"

    def publish(self, targets: Iterable[ModelTarget], metrics: GatewayMetrics) -> None:
        """Each model's ready replicas, SLO and endpoint states on `metrics`' gauges."""
        rows = []
        for target in targets:
            names = labels(target)
            metrics.ready_endpoints.labels(*names).set(len(self.candidates(target)))
            s = target.slo
            metrics.publish_slo(names, s.ttft_seconds, s.itl_seconds, s.objective)
            rows += [(names, e.url, self.state(e)) for e in target.endpoints]
        metrics.publish_endpoints(rows)


def home(request: RoutingRequest, urls: Sequence[str]) -> str | None:
    """The first of `urls` in the request's rendezvous order."""
    key = request.affinity_key
    if key is None or not urls:
        return None
    return max(urls, key=lambda url: rendezvous_weight(key, url))
