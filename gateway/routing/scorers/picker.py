"""Compose filters and weighted scorers into a picker, one profile per routing policy.

score(endpoint) = sum(weight_i * scorer_i(endpoint)); candidates are returned
best first (ties broken at random), so the proxy can retry down the list.

Policies (`spec.routing.policy`):

- prefix-aware: bounded-load filter, then session 8, prefix match 4,
  consistent home 2, in-flight 0.5, queue 0.25, KV cache 0.25. Load scores
  sum to at most 1 < 2, so the home replica (the first of the prompt's
  rendezvous order still within the bound) wins unless a longer prefix match
  lives elsewhere. A cold prompt (matched nowhere) therefore goes home even
  when another replica is lighter: where a new prefix starts depends only on
  the prompt, the endpoint set and the bound, never on which gateway saw it
  first, so with several gateways a prefix still lives on one replica (until
  its load passes the bound, then on the next in the same order on every
  gateway). The price is balance: unshared prompts spread like consistent
  hashing with bounded loads (no replica past loadBound x the mean), not like
  least-load. So the router (gateway/router.py) routes a cold prompt by the
  least-load profile instead while the model's recent traffic shares almost no
  prefixes (`prefix.Sharing`), and does not index a cold prompt where it went
  other than home, so no gateway pins a prefix to a replica only it knows of.
  The router (gateway/routing/router.py) widens the bounded-load filter to 2 x the
  bound for the replicas that hold at least half of the prompt's prefix
  (`bounded_load.within_bound_or_holding`).
- least-load: bounded-load filter, session 8, in-flight 2, queue 1, KV cache 1.
- round-robin: each candidate in turn.
- slo-aware: no load filter; each candidate scored 1 / (1 + cost), where cost is the larger
  of its predicted TTFT and ITL over the model's targets (routing/latency.py, learnt per
  replica), weight 10, the prompt's home 0.05 for near-ties. Built per request by the
  router (`Router.slo_profile`); the entry here is its shape without predictions.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest, Scorer
from kubellm.gateway.routing.scorers.bounded_load import within_bound
from kubellm.gateway.routing.scorers.consistent_hash import ConsistentHashScorer
from kubellm.gateway.routing.scorers.in_flight import InFlightScorer
from kubellm.gateway.routing.scorers.kv_cache import KVCacheScorer
from kubellm.gateway.routing.scorers.prefix import PrefixIndex, PrefixScorer
from kubellm.gateway.routing.scorers.queue import QueueScorer
from kubellm.gateway.routing.scorers.round_robin import RoundRobinScorer
from kubellm.gateway.routing.scorers.session import SessionScorer, SessionTable

Filter = Callable[[Sequence[Candidate], float], list[Candidate]]


@dataclass
class Profile:
    """Filters, then weighted scorers."""

    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]


def pick(
    profile: Profile,
    request: RoutingRequest,
    candidates: Sequence[Candidate],
    load_bound: float,
    rng: random.Random | None = None,
) -> list[Candidate]:
    """Candidates best first: filtered ones by weighted score, then those filtered out."""
    rng = rng or random
    kept: list[Candidate] = list(candidates)
    for keep in profile.filters:
        kept = keep(kept, load_bound)
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
    """The policies, sharing one prefix index and one session table."""
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
        ),
        "least-load": Profile(filters=[within_bound], scorers=least_load),
        "round-robin": Profile(filters=[], scorers=[(RoundRobinScorer(), 1.0)]),
        "slo-aware": Profile(filters=[], scorers=[(ConsistentHashScorer(), 1.0)]),
    }
