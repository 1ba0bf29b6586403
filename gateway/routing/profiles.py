"""Which replica gets this request: the one place that answers it.

A profile (one per `spec.routing.policy`) declares its members by name, filters first,
then weighted scorers; members come from a registry (`register`). For each request the
router picks the profile (`Profiles.choose`), binds every member to the request
(`Member.bind`: scorers first, so a scorer can tell the filters what it found), and the
pure picker (`scorers/picker.py`: score = sum(weight x scorer), best first) ranks the
candidates. Nothing edits a profile per request.

Profiles:

- prefix-aware: bounded-load, then lora-affinity 20, session 8, prefix 4, home 2,
  in-flight 0.5, queue 0.25, kv-cache 0.25. Load scores sum to at most 1 < 2, so the
  prompt's home (the first of its rendezvous order still within the bound) wins unless
  a longer prefix match lives elsewhere, so where a new prefix starts depends only on
  the prompt, the endpoint set and the bound, never on which gateway saw it first. The
  price is balance, so a *cold* prompt (this gateway never routed its first chunk) of a
  model whose recent traffic shares almost no prefixes (`prefix.Sharing`) is routed by
  the profile's `cold` choice, least-load.
- least-load: bounded-load, then lora-affinity 20, session 8, in-flight 2, queue 1,
  kv-cache 1.
- round-robin: round-robin 1 (no filter, no affinity).
- slo-aware: no load filter; lora-affinity 20, slo 10, home 0.05. `slo` scores each
  candidate 1 / (1 + cost), the cost being the worst of its predicted TTFT and ITL over
  the model's targets and the ITL it leaves the streams already there
  (`routing/latency/predictions.py`, the per-replica model of `routing/latency/model.py`); a prefix
  held enters only as a shorter predicted prefill. When no candidate is predicted within
  reach (every cost over latency.OUT_OF_REACH, 1.5) the order reverses, cost /
  (1 + cost): a request that misses anyway goes to the replica already worst off
  (`latency.slo_scores`). Between
  two replicas predicted at 0.30 and 0.31 of the TTFT target the slo scores differ by
  10 x 0.0074 = 0.074 > 0.05: the prompt's home wins only near-ties (under ~0.7% of
  the SLO), enough to keep a shared prefix on one replica while the fleet is idle.

Members and what they tell each other through the request's `Cycle`:

- prefix: the approximate index, or with `spec.routing.prefixIndex: precise` the KV
  events (`scorers/precise.py`, the prompt hashed as vLLM does); it scores every
  candidate once, before any filter, and marks the candidates holding at least
  HOLDER_SHARE of the prompt (`Cycle.held`). The approximate index knows only what this
  front end sent: where it knows no holder and nothing says the model's traffic is
  unshared (`prefix.Sharing.may_share`: not a full window of prompts without a repeat),
  the prompt's home (the first of its rendezvous order) is marked as its presumed holder,
  since every front end starts a prefix there. With N
  front ends each sees a prefix's requests 1/N as often, so without the presumption most
  of them looked new to the front end they reached and spilled off a busy home that
  holds the prefix (the hit rate fell from 61.9% at N = 1 to 53.2% at N = 3,
  docs/operations.md);
- bounded-load: `bounded_load.within_bound`, widened to HOLDER_SLACK x the bound for the
  held candidates (`within_bound_or_holding`), and letting through whatever a member
  asked for (`Cycle.let_through`: lora-affinity's residents);
- lora-affinity: `adapters.AdapterScorer` with the placement plan over all the model's
  replicas, for requests naming an adapter (off with `--adapter-routing blind`).

- revision: while a canary rollout splits the model, the candidates of the revision the
  request goes to (`revisions.for_request`). It is registered `every_profile`: such a
  filter narrows the candidates before any other member binds, and what it drops is not
  even a last resort (the picker appends what the profile's own filters drop; the
  scheduler's retry tail is narrowed alike, `Profiles.narrow`).

Adding a filter or a profile is a change to one file, this one (or a module of its own
imported here): `register` the member (`every_profile=True`: a filter every profile
applies first, outright), or `declare` a profile; a member has one method, `bind(cycle)`,
that returns its filter or scorer for a request.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kubellm.gateway.discovery.base import ModelTarget
from kubellm.gateway.routing.canary.revisions import for_request as revision_candidates
from kubellm.gateway.routing.index import approx_tiers
from kubellm.gateway.routing.index.precise_routing import PreciseRouting
from kubellm.gateway.routing.latency.model import slo_scores
from kubellm.gateway.routing.latency.predictions import Predictions
from kubellm.gateway.routing.replicas.adapters import AdapterScorer
from kubellm.gateway.routing.scorers import prefix
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest, Scorer
from kubellm.gateway.routing.scorers.bounded_load import (
    Filter,
    within_bound,
    within_bound_or_holding,
)
from kubellm.gateway.routing.scorers.consistent_hash import ConsistentHashScorer, rendezvous_weight
from kubellm.gateway.routing.scorers.in_flight import InFlightScorer
from kubellm.gateway.routing.scorers.kv_cache import KVCacheScorer
from kubellm.gateway.routing.scorers.picker import Profile, pick
from kubellm.gateway.routing.scorers.precise import PrecisePrefixScorer
from kubellm.gateway.routing.scorers.queue import QueueScorer
from kubellm.gateway.routing.scorers.round_robin import RoundRobinScorer
from kubellm.gateway.routing.scorers.session import SessionScorer, SessionTable

# Prefix holders and the load bound: a candidate holding at least HOLDER_SHARE of the
# prompt's prefix may take the request up to HOLDER_SLACK x spec.routing.loadBound x the
# mean load, not loadBound x the mean. Under cache pressure (bench/gateway/routing.py
# --workloads pressure, seed 7) this raised the hit rate from 49.2% to 65.7% (approximate
# index) and from 58.2% to 66.5% (precise), the fleet's pool as one LRU being 68.6%, with
# TTFT p95 unchanged (0.086-0.087 s); see docs/operations.md.
HOLDER_SHARE = 0.5
HOLDER_SLACK = 2.0

# The LoRA affinity scorer's weight. Its tiers are 0.25 apart (resident at its planned
# home 1, resident elsewhere 0.75, its planned home 0.5); x 20 = 5 per tier, more than
# the load scorers' whole range (4 in least-load, 1 in prefix-aware) and a full prefix
# match plus the prompt's home (4 + 2 = 6 less one tier): a request goes where its adapter
# is in a slot unless the bounded-load filter says that replica is full, as a prefix goes
# home (an adapter swap costs more than a prefix miss: tens of ms of disk reads, and a
# request past the batch's max_loras adapters waits for a slot).
ADAPTER_WEIGHT = 20.0

# slo-aware's weights (see the module's list of profiles).
SLO_WEIGHT = 10.0
HOME_WEIGHT = 0.05


@dataclass
class Shared:
    """What members read, one per router: the prefix index, sessions, precise routing,
    the adapter view (None: adapter-blind routing), the latency predictions."""

    index: prefix.PrefixIndex
    sessions: SessionTable
    precise: PreciseRouting | None = None
    adapters: AdapterScorer | None = None
    predictions: Predictions | None = None
    sharing: prefix.Sharing | None = None  # None: no presumed holder (see `_Prefix`)


@dataclass(slots=True)
class Cycle:
    """One request's pass through a profile: what members found for the others."""

    target: ModelTarget
    request: RoutingRequest
    candidates: Sequence[Candidate]
    held: set[str] = field(default_factory=set)  # hold >= HOLDER_SHARE of the prompt
    let_through: list[Filter] = field(default_factory=list)  # kept past the load bound


class Member(Protocol):
    """A profile member bound per request: a scorer or a filter, or None (not used for
    this request).

    A member may also have `lone(cycle) -> bool`, asked where the request has one
    candidate: True when its scorer or filter could not change that order of one (a
    stateless scorer; a filter that never empties a set), with whatever else its `bind`
    does besides scoring done (idempotent); False: bind it. A member without `lone` is
    always bound."""

    def bind(self, cycle: Cycle) -> Scorer | Filter | None: ...


MemberFactory = Callable[[Shared], Member]
REGISTRY: dict[str, MemberFactory] = {}
EVERY_PROFILE: list[str] = []  # filters every profile applies first


def register(name: str, every_profile: bool = False) -> Callable[[MemberFactory], MemberFactory]:
    """Register a member factory under `name` (a decorator)."""

    def add(factory: MemberFactory) -> MemberFactory:
        if name in REGISTRY:
            raise ValueError(f"routing member {name!r} is registered twice")
        REGISTRY[name] = factory
        if every_profile:
            EVERY_PROFILE.append(name)
        return factory

    return add


@dataclass(frozen=True)
class ProfileSpec:
    """A profile: its filters and weighted scorers by registry name, and the profile a
    cold prompt of a model with unshared traffic takes instead (None: this one)."""

    filters: tuple[str, ...]
    scorers: tuple[tuple[str, float], ...]
    cold: str | None = None


PROFILES: dict[str, ProfileSpec] = {}


def declare(name: str, spec: ProfileSpec) -> None:
    """Declare profile `name` (a `spec.routing.policy` value)."""
    if name in PROFILES:
        raise ValueError(f"routing profile {name!r} is declared twice")
    PROFILES[name] = spec


class _Fixed:
    """A member that is the same scorer or filter for every request."""

    def __init__(self, member: Scorer | Filter) -> None:
        self.member = member

    def bind(self, cycle: Cycle) -> Scorer | Filter | None:
        return self.member


class Scored:
    """A scorer whose scores, by candidate URL, were computed before the filters ran."""

    stateless = True

    def __init__(self, name: str, by_url: dict[str, float]) -> None:
        self.name = name
        self.by_url = by_url

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [self.by_url.get(c.url, 0.0) for c in candidates]


class _Prefix:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.approximate = prefix.PrefixScorer(shared.index)

    def bind(self, cycle: Cycle) -> Scorer | Filter | None:
        target, precise = cycle.target, self.shared.precise
        scorer: prefix.PrefixScorer | PrecisePrefixScorer = self.approximate
        if target.routing.prefix_index == "precise" and precise is not None:
            cycle.request = cycle.request._replace(
                kv_hashes=precise.kv_hashes(target, cycle.request.body)
            )
            scorer = PrecisePrefixScorer(
                precise.index, precise.fresh, self.shared.index,
                precise.fallback(target.served_name),
            )  # fmt: skip
        self._set_tiers(cycle)
        scores = scorer.score(cycle.request, cycle.candidates)
        shares = {c.url: s for c, s in zip(cycle.candidates, scores, strict=True)}
        cycle.held = {url for url, share in shares.items() if share >= HOLDER_SHARE}
        sharing, request = self.shared.sharing, cycle.request
        if (
            not cycle.held
            and shares
            and scorer is self.approximate
            and sharing is not None
            and request.chunk_hashes
            and request.affinity_key is not None
            and sharing.may_share(request.model)
        ):  # no holder known to this front end: the prompt's home, where prefixes start
            key = request.affinity_key
            cycle.held = {max(shares, key=lambda url: rendezvous_weight(key, url))}
        return Scored(scorer.name, shares)

    def lone(self, cycle: Cycle) -> bool:
        """The approximate index's scores only rank, and mark holders for the bounded-load
        filter, which keeps a lone candidate anyway: only its tiers are set (the precise
        index counts its fallbacks as it scores: bound)."""
        if cycle.target.routing.prefix_index == "precise" and self.shared.precise is not None:
            return False
        self._set_tiers(cycle)
        return True

    def _set_tiers(self, cycle: Cycle) -> None:
        """Each candidate's KV tiers in the approximate index (a host tier: it models both)."""
        tiers = cycle.target.kv_tier_tokens
        chunks = (
            None
            if tiers is None
            else approx_tiers.ChunkTiers.from_tokens(*tiers, prefix.CHUNK_CHARS)
        )
        for c in cycle.candidates:
            self.shared.index.set_tiers(c.url, chunks)


class _BoundedLoad:
    def lone(self, cycle: Cycle) -> bool:
        return True  # the least-loaded candidate always passes: a lone one is kept

    def bind(self, cycle: Cycle) -> Scorer | Filter | None:
        bound: Filter = (
            within_bound_or_holding(frozenset(cycle.held), HOLDER_SLACK)
            if cycle.held
            else within_bound
        )
        for extra in cycle.let_through:
            bound = either(bound, extra)
        return bound


class _AdapterAffinity:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def lone(self, cycle: Cycle) -> bool:
        return self.shared.adapters is None or cycle.request.adapter is None  # unbound

    def bind(self, cycle: Cycle) -> Scorer | Filter | None:
        adapters, name = self.shared.adapters, cycle.request.adapter
        if adapters is None or name is None:
            return None
        # the placement plan covers all the model's replicas, not just these candidates
        urls = [e.url for e in cycle.target.routable]
        scorer = adapters.for_replicas(urls, cycle.target.routing.load_bound)
        cycle.let_through.append(scorer.bound_filter(name))
        return scorer


class _Slo:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def bind(self, cycle: Cycle) -> Scorer | Filter | None:
        predictions = self.shared.predictions
        if predictions is None:
            return None
        slo = cycle.target.slo
        cached = predictions.tiered(cycle.target, cycle.request)  # the KV events' tiers
        costs = predictions.costs(
            cycle.request, cycle.candidates, slo.ttft_seconds, slo.itl_seconds, cached
        )
        return Scored("slo", slo_scores({url: cost for url, (cost, _, _) in costs.items()}))


class _Revision:
    def bind(self, cycle: Cycle) -> Scorer | Filter | None:
        if cycle.target.canary is None:
            return None
        target, request = cycle.target, cycle.request
        return lambda candidates, _bound: revision_candidates(target, request, candidates)


def either(a: Filter, b: Filter) -> Filter:
    """The candidates that either filter keeps."""

    def keep(candidates: Sequence[Candidate], load_bound: float) -> list[Candidate]:
        urls = {c.url for c in a(candidates, load_bound)} | {
            c.url for c in b(candidates, load_bound)
        }
        return [c for c in candidates if c.url in urls]

    return keep


register("revision", every_profile=True)(lambda shared: _Revision())
register("bounded-load")(lambda shared: _BoundedLoad())
register("prefix")(_Prefix)
register("lora-affinity")(_AdapterAffinity)
register("session")(lambda shared: _Fixed(SessionScorer(shared.sessions)))
register("home")(lambda shared: _Fixed(ConsistentHashScorer()))
register("in-flight")(lambda shared: _Fixed(InFlightScorer()))
register("queue")(lambda shared: _Fixed(QueueScorer()))
register("kv-cache")(lambda shared: _Fixed(KVCacheScorer()))
register("round-robin")(lambda shared: _Fixed(RoundRobinScorer()))
register("slo")(_Slo)

declare(
    "prefix-aware",
    ProfileSpec(
        filters=("bounded-load",),
        scorers=(
            ("lora-affinity", ADAPTER_WEIGHT), ("session", 8.0), ("prefix", 4.0),
            ("home", 2.0), ("in-flight", 0.5), ("queue", 0.25), ("kv-cache", 0.25),
        ),
        cold="least-load",
    ),
)  # fmt: skip
declare(
    "least-load",
    ProfileSpec(
        filters=("bounded-load",),
        scorers=(
            ("lora-affinity", ADAPTER_WEIGHT), ("session", 8.0), ("in-flight", 2.0),
            ("queue", 1.0), ("kv-cache", 1.0),
        ),
    ),
)  # fmt: skip
declare("round-robin", ProfileSpec(filters=(), scorers=(("round-robin", 1.0),)))
declare(
    "slo-aware",
    ProfileSpec(
        filters=(),
        scorers=(("lora-affinity", ADAPTER_WEIGHT), ("slo", SLO_WEIGHT), ("home", HOME_WEIGHT)),
    ),
)


_Entry = tuple["Scorer | Filter | None", float, "Member | None"]


def _lone_members(entries: list[_Entry]) -> list[Member] | None:
    """The members of a profile to ask `lone` (see `Member`), or None where one of them
    must always be bound: a fixed scorer not marked stateless, a member without `lone`."""
    members = []
    for fixed, _, member in entries:
        if member is None:
            if not getattr(fixed, "stateless", False):
                return None
        elif hasattr(member, "lone"):
            members.append(member)
        else:
            return None
    return members


def _entry(member: Member, weight: float) -> _Entry:
    """(the member bound once, weight, None) for a fixed member, else (None, weight, it)."""
    if isinstance(member, _Fixed):
        return member.member, weight, None
    return None, weight, member


class Profiles:
    """The declared profiles with their members built once for one router's state."""

    def __init__(self, shared: Shared, cold: Callable[[RoutingRequest], bool]) -> None:
        self.shared = shared
        self.cold = cold  # a cold prompt of a model whose traffic shares no prefixes
        self.members: dict[str, Member] = {}
        for spec in PROFILES.values():
            for name in (*EVERY_PROFILE, *spec.filters, *(n for n, _ in spec.scorers)):
                if name not in self.members:
                    if name not in REGISTRY:
                        raise ValueError(f"routing profile member {name!r} is not registered")
                    self.members[name] = REGISTRY[name](shared)
        # per profile, its members in binding order, looked up once; a member that is the
        # same for every request is bound now, not per request
        self._bound: dict[str, tuple[list[_Entry], list[_Entry]]] = {
            name: (
                [_entry(self.members[m], w) for m, w in spec.scorers],
                [_entry(self.members[m], 0.0) for m in spec.filters],
            )
            for name, spec in PROFILES.items()
        }
        self._narrowing = [self.members[m] for m in EVERY_PROFILE]
        # per profile, the members to ask `lone` for a request with one candidate; None
        # where a member is always bound there (a stateful scorer, a member without `lone`)
        self._lone: dict[str, list[Member] | None] = {
            name: _lone_members(scorers + filters)
            for name, (scorers, filters) in self._bound.items()
        }

    def choose(self, target: ModelTarget, request: RoutingRequest) -> str:
        """The profile for this request: the model's policy, or its `cold` choice."""
        name = target.routing.policy
        cold = PROFILES[name].cold
        return cold if cold is not None and self.cold(request) else name

    def bind(
        self,
        name: str,
        target: ModelTarget,
        request: RoutingRequest,
        candidates: Sequence[Candidate],
    ) -> tuple[Profile, RoutingRequest]:
        """Profile `name`'s members bound to one request (scorers first: they may tell
        the filters what they found), and the request as the members completed it."""
        scorer_entries, filter_entries = self._bound[name]
        cycle = Cycle(target, request, candidates)
        scorers = []
        for fixed, weight, member in scorer_entries:
            scorer = fixed if member is None else member.bind(cycle)
            if scorer is not None:
                scorers.append((scorer, weight))
        filters = []
        for fixed, _, member in filter_entries:
            bound = fixed if member is None else member.bind(cycle)
            if bound is not None:
                filters.append(bound)
        return Profile(filters, scorers), cycle.request  # type: ignore[arg-type]

    def order(
        self,
        target: ModelTarget,
        request: RoutingRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        name: str | None = None,
    ) -> list[Candidate]:
        """The candidates best first for this request (`name`: this profile, not the
        chosen one), among those the every-profile filters keep (`narrow`)."""
        # one cycle for the every-profile filters and, with one candidate left, `lone`
        cycle = self._narrowed(Cycle(target, request, candidates))
        candidates = cycle.candidates
        name = name or self.choose(target, request)
        if len(candidates) == 1 and self._alone(name, cycle):
            rng.random()  # the tie-break `pick` draws for its one candidate
            return list(candidates)
        profile, request = self.bind(name, target, request, candidates)
        return pick(profile, request, candidates, target.routing.load_bound, rng)

    def _alone(self, name: str, cycle: Cycle) -> bool:
        """One candidate, and no member of profile `name` could change the order of one
        (`Member.lone`, which did the rest of what binding does): it goes first, unbound."""
        members = self._lone[name]
        if members is None:
            return False
        for member in members:  # noqa: SIM110 (a loop: no generator built per request)
            if not member.lone(cycle):  # type: ignore[attr-defined]
                return False
        return True

    def narrow(
        self, target: ModelTarget, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        """`candidates` as the every-profile filters (the revision filter) keep them."""
        if not self._narrowing:
            return candidates
        return self._narrowed(Cycle(target, request, candidates)).candidates

    def _narrowed(self, cycle: Cycle) -> Cycle:
        """`cycle` with its candidates narrowed by the every-profile filters (`narrow`)."""
        for member in self._narrowing:
            keep = member.bind(cycle)
            if keep is not None:
                cycle.candidates = keep(cycle.candidates, cycle.target.routing.load_bound)  # type: ignore[call-arg]
        return cycle
