"""The routing state of one gateway process, around the pure picker.

Holds what scorers read (prefix index, session table, load view, outlier
record) and turns a model's endpoints into ordered candidates: health filters
first (not draining, not ejected), then the policy's filters and scorers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kubellm.gateway.discovery.base import ModelTarget
from kubellm.gateway.routing.adapters import AdapterScorer
from kubellm.gateway.routing.load import LoadView
from kubellm.gateway.routing.outliers import OutlierDetector
from kubellm.gateway.routing.precise import PreciseRouting
from kubellm.gateway.routing.predicted import Predictions
from kubellm.gateway.routing.scorers import prefix
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.scorers.bounded_load import (
    Filter,
    within_bound,
    within_bound_or_holding,
)
from kubellm.gateway.routing.scorers.consistent_hash import (
    ConsistentHashScorer,
    rendezvous_weight,
)
from kubellm.gateway.routing.scorers.picker import Profile, pick, profiles
from kubellm.gateway.routing.scorers.precise import PrecisePrefixScorer
from kubellm.gateway.routing.scorers.session import SessionTable
from prometheus_client import CollectorRegistry


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
    user = body.get("user")
    return RoutingRequest(
        model=model,
        chunk_hashes=hashes,
        affinity_key=prefix.affinity_key(text, hashes),
        session=session or (user if isinstance(user, str) and user else None),
        body=body,
        adapter=adapter,
        prompt_chars=len(text),
    )


# The LoRA affinity scorer's weight. Its tiers are 0.25 apart (resident at its planned
# home 1, resident elsewhere 0.75, its planned home 0.5); x 20 = 5 per tier, more than
# the load scorers' whole range (4 in least-load, 1 in prefix-aware) and a full prefix
# match plus the prompt's home (4 + 2 = 6 less one tier): a request goes where its adapter
# is in a slot unless the bounded-load filter says that replica is full, as a prefix goes
# home (an adapter swap costs more than a prefix miss: tens of ms of disk reads, and a
# request past the batch's max_loras adapters waits for a slot).
ADAPTER_WEIGHT = 20.0

# Prefix holders and the load bound (bounded_load.within_bound_or_holding): a candidate
# holding at least HOLDER_SHARE of the prompt's prefix may take the request up to
# HOLDER_SLACK x spec.routing.loadBound x the mean load, not loadBound x the mean. Under
# cache pressure (bench/gateway_routing.py --workloads pressure, seed 7) this raised the
# hit rate from 49.2% to 65.7% (approximate index) and from 58.2% to 66.5% (precise), the
# fleet's pool as one LRU being 68.6%, with TTFT p95 unchanged (0.086-0.087 s); see
# docs/operations.md.
HOLDER_SHARE = 0.5
HOLDER_SLACK = 2.0

# slo-aware: score 1 / (1 + cost), cost = the larger of predicted TTFT / target and
# predicted ITL / target (latency.slo_cost), x SLO_WEIGHT; the prompt's rendezvous home adds
# HOME_WEIGHT. Between two replicas predicted 0.3 and 0.31 of the TTFT target the score
# differs by 10 x 0.0074 = 0.074 > 0.05: the home wins only near-ties (under ~0.7% of the
# SLO), enough to keep a shared prefix on one replica when the fleet is idle.
SLO_WEIGHT = 10.0
HOME_WEIGHT = 0.05


class Router:
    def __init__(
        self,
        load: LoadView,
        outliers: OutlierDetector,
        rng: random.Random | None = None,
        index_capacity: int = 65_536,
        precise: PreciseRouting | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.load = load
        self.outliers = outliers
        self.rng = rng or random.Random()
        self.index = prefix.PrefixIndex(index_capacity)
        self.sessions = SessionTable()
        self.sharing = prefix.Sharing()
        self.profiles = profiles(self.index, self.sessions)
        self.home_scorer = ConsistentHashScorer()
        self.precise = precise
        self.predictions = Predictions(registry=registry)
        self.adapter_scorer: AdapterScorer | None = None  # None: adapter-blind routing

    def candidates(self, target: ModelTarget) -> list[Candidate]:
        """Endpoints that may take a new request: routable, not ejected, and not down (the
        latest scrape failed), unless every one that is not ejected is down: then those,
        since an engine without working metrics may still answer."""
        alive = [e for e in target.routable if not self.outliers.ejected(e.url)]
        healthy = [e for e in alive if not self.load.down(e.url)]
        out = []
        for endpoint in healthy or alive:
            stats = self.load.stats(endpoint.url)
            out.append(
                Candidate(
                    url=endpoint.url,
                    load=self.load.load(endpoint.url),
                    in_flight=self.load.in_flight.get(endpoint.url, 0),
                    waiting=None if stats is None else stats.waiting,
                    kv_usage=None if stats is None else stats.kv_usage,
                    running=None if stats is None else stats.running,
                )
            )
        return out

    def order(
        self, target: ModelTarget, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> list[Candidate]:
        policy = target.routing.policy
        if policy == "prefix-aware" and self.unshared(request):
            policy = "least-load"
        profile = self.profiles[policy]
        bound: Filter = within_bound
        if policy == "slo-aware":
            profile = self.slo_profile(target, request, candidates)
        if policy == "prefix-aware":
            if target.routing.prefix_index == "precise" and self.precise:
                request = replace(request, kv_hashes=self.precise.kv_hashes(target, request.body))
                profile = precise_profile(profile, self.precise, self.index, target.served_name)
            profile, held = prefix_held(profile, request, candidates)
            bound = within_bound_or_holding(held, HOLDER_SLACK)
        if request.adapter is not None and self.adapter_scorer is not None and profile.filters:
            # LoRA affinity first (no adapter swap), then the policy's own scorers; the
            # placement plan covers all the model's replicas, not just these candidates
            urls = [e.url for e in target.routable]
            scorer = self.adapter_scorer.for_replicas(urls, target.routing.load_bound)
            bound = either(bound, scorer.bound_filter(request.adapter))
            profile = Profile(profile.filters, [(scorer, ADAPTER_WEIGHT), *profile.scorers])
        filters = [bound if f is within_bound else f for f in profile.filters]
        return pick(
            Profile(filters, profile.scorers),
            request,
            candidates,
            target.routing.load_bound,
            self.rng,
        )

    def slo_profile(
        self, target: ModelTarget, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> Profile:
        """The `slo-aware` profile for this request: each candidate scored by how well its
        predicted TTFT and ITL keep within the model's targets (routing/predicted.py), the
        prompt's rendezvous home breaking near-ties (so a shared prefix starts in one place)."""
        slo = target.slo
        costs = self.predictions.costs(request, candidates, slo.ttft_seconds, slo.itl_seconds)
        scores = {url: 1.0 / (1.0 + cost) for url, (cost, _, _) in costs.items()}
        return Profile(
            filters=[],
            scorers=[(Scored("slo-aware", scores), SLO_WEIGHT), (self.home_scorer, HOME_WEIGHT)],
        )

    def unshared(self, request: RoutingRequest) -> bool:
        """A cold prompt (this gateway never routed its first chunk) of a model whose
        recent traffic shares almost no prefixes: load decides, not the prompt's home."""
        hashes = request.chunk_hashes
        return self.sharing.low(request.model) and not (hashes and self.sharing.seen(hashes[0]))

    def routed(self, request: RoutingRequest, url: str, candidates: Sequence[str]) -> float:
        """Remember where a request went; returns the prefix match ratio it had there.

        A cold prompt that went elsewhere than its home (the home was past the load
        bound, or load decided) is not indexed there: this gateway would otherwise
        keep sending its prefix to a replica other gateways know nothing of. Its
        next request goes home, or to the same next replica every gateway picks.
        """
        hashes = request.chunk_hashes
        total = len(hashes)
        ratio = self.index.matched(url, hashes) / total if total else 0.0
        cold = bool(total) and not self.sharing.observe(request.model, hashes[0])
        if not cold or url == home(request, candidates):
            self.index.record(url, hashes)
        if request.session:
            self.sessions.record(request.session, url)
        return ratio


def prefix_held(
    profile: Profile, request: RoutingRequest, candidates: Sequence[Candidate]
) -> tuple[Profile, set[str]]:
    """Score the prompt's prefix match on every candidate once, before the load filter:
    returns `profile` with its prefix scorer replaced by those scores, and the candidates
    that hold at least `HOLDER_SHARE` of the prompt (the load filter widens for them)."""
    scorers = []
    held: set[str] = set()
    for scorer, weight in profile.scorers:
        if isinstance(scorer, prefix.PrefixScorer | PrecisePrefixScorer):
            scores = scorer.score(request, candidates)
            shares = {c.url: share for c, share in zip(candidates, scores, strict=True)}
            held = {url for url, share in shares.items() if share >= HOLDER_SHARE}
            scorer = Scored(scorer.name, shares)
        scorers.append((scorer, weight))
    return Profile(profile.filters, scorers), held


def either(a: Filter, b: Filter) -> Filter:
    """The candidates that either filter keeps."""

    def keep(candidates: Sequence[Candidate], load_bound: float) -> list[Candidate]:
        urls = {c.url for c in a(candidates, load_bound)} | {
            c.url for c in b(candidates, load_bound)
        }
        return [c for c in candidates if c.url in urls]

    return keep


class Scored:
    """A scorer whose scores, by candidate URL, were computed before the filters ran."""

    def __init__(self, name: str, by_url: dict[str, float]) -> None:
        self.name = name
        self.by_url = by_url

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [self.by_url.get(c.url, 0.0) for c in candidates]


def precise_profile(
    profile: Profile, precise: PreciseRouting, index: prefix.PrefixIndex, model: str
) -> Profile:
    """`profile` with its approximate prefix scorer replaced by the precise one (same
    weight), which falls back to `index` per replica whose KV events are not fresh."""
    scorer = PrecisePrefixScorer(precise.index, precise.fresh, index, precise.fallback(model))
    scorers = [(scorer if isinstance(s, prefix.PrefixScorer) else s, w) for s, w in profile.scorers]
    return Profile(filters=profile.filters, scorers=scorers)


def home(request: RoutingRequest, urls: Sequence[str]) -> str | None:
    """The first of `urls` in the request's rendezvous order."""
    key = request.affinity_key
    if key is None or not urls:
        return None
    return max(urls, key=lambda url: rendezvous_weight(key, url))
