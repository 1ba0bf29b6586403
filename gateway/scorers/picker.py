"""Compose filters and weighted scorers into a picker, one profile per routing policy.

score(endpoint) = sum(weight_i * scorer_i(endpoint)); candidates are returned
best first (ties broken at random), so the proxy can retry down the list.

Policies (`spec.routing.policy`):

- prefix-aware: bounded-load filter, then session 8, prefix match 4,
  consistent home 2, in-flight 0.5, queue 0.25, KV cache 0.25. Load scores
  sum to at most 1 < 2, so the home replica wins unless a longer prefix
  match lives elsewhere or the bound removed it.
  A cold request (no endpoint's index holds even its prompt's first chunk,
  so no replica can have it cached) gains nothing from one fixed home: it
  chooses between its first COLD_CHOICES replicas in rendezvous order by load
  (in-flight 2, queue 1, KV cache 0.5; home 1 breaks near-ties), then session 8.
  This is "the power of two choices" over a consistent pair: unshared prompts
  spread by load, while a new prefix starts on one of the same two replicas
  whichever gateway sees it first, so with several gateways it lives on at most
  two replicas. Once it is somewhere, later requests follow the prefix match.
- least-load: bounded-load filter, session 8, in-flight 2, queue 1, KV cache 1.
- round-robin: each candidate in turn.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kubellm.gateway.scorers.base import Candidate, RoutingRequest, Scorer
from kubellm.gateway.scorers.bounded_load import within_bound
from kubellm.gateway.scorers.consistent_hash import ConsistentHashScorer, rendezvous_top
from kubellm.gateway.scorers.in_flight import InFlightScorer
from kubellm.gateway.scorers.kv_cache import KVCacheScorer
from kubellm.gateway.scorers.prefix import PrefixIndex, PrefixScorer
from kubellm.gateway.scorers.queue import QueueScorer
from kubellm.gateway.scorers.round_robin import RoundRobinScorer
from kubellm.gateway.scorers.session import SessionScorer, SessionTable

COLD_CHOICES = 2

Filter = Callable[[Sequence[Candidate], float], list[Candidate]]


@dataclass
class Profile:
    """Filters, then (optionally) the request's first `choices` replicas in rendezvous
    order, then weighted scorers.

    `cold` replaces this profile for a request that `is_warm` says no candidate
    (before the filters) may hold cached; without them every request is warm.
    """

    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    choices: int | None = None
    cold: Profile | None = None
    is_warm: Callable[[RoutingRequest, Sequence[Candidate]], bool] | None = None


def pick(
    profile: Profile,
    request: RoutingRequest,
    candidates: Sequence[Candidate],
    load_bound: float,
    rng: random.Random | None = None,
) -> list[Candidate]:
    """Candidates best first: filtered ones by weighted score, then those filtered out."""
    rng = rng or random
    if profile.cold is not None and profile.is_warm and not profile.is_warm(request, candidates):
        profile = profile.cold
    kept: list[Candidate] = list(candidates)
    for keep in profile.filters:
        kept = keep(kept, load_bound)
    if profile.choices:
        kept = rendezvous_top(request, kept, profile.choices)
    totals = [0.0] * len(kept)
    for scorer, weight in profile.scorers:
        for i, value in enumerate(scorer.score(request, kept)):
            totals[i] += weight * value
    ranked = sorted(range(len(kept)), key=lambda i: (-totals[i], rng.random()))
    best = [kept[i] for i in ranked]
    chosen = {c.url for c in best}
    rest = sorted((c for c in candidates if c.url not in chosen), key=lambda c: c.load)
    return best + rest


def profiles(index: PrefixIndex, sessions: SessionTable) -> dict[str, Profile]:
    """The three policies, sharing one prefix index and one session table."""
    session = SessionScorer(sessions)
    least_load: list[tuple[Scorer, float]] = [
        (session, 8.0),
        (InFlightScorer(), 2.0),
        (QueueScorer(), 1.0),
        (KVCacheScorer(), 1.0),
    ]
    return {
        "prefix-aware": Profile(
            filters=[within_bound],
            scorers=[
                (session, 8.0),
                (PrefixScorer(index), 4.0),
                (ConsistentHashScorer(), 2.0),
                (InFlightScorer(), 0.5),
                (QueueScorer(), 0.25),
                (KVCacheScorer(), 0.25),
            ],
            cold=Profile(
                filters=[within_bound],
                choices=COLD_CHOICES,
                scorers=[
                    (session, 8.0),
                    (InFlightScorer(), 2.0),
                    (QueueScorer(), 1.0),
                    (ConsistentHashScorer(), 1.0),
                    (KVCacheScorer(), 0.5),
                ],
            ),
            is_warm=lambda request, candidates: index.held_anywhere(
                request.chunk_hashes, [c.url for c in candidates]
            ),
        ),
        "least-load": Profile(filters=[within_bound], scorers=least_load),
        "round-robin": Profile(filters=[], scorers=[(RoundRobinScorer(), 1.0)]),
    }
