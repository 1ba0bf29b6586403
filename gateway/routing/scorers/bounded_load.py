"""The bounded-load filter (consistent hashing with bounded loads, Mirrokni et al.).

An endpoint may take the request only if its load after taking it stays within
capacity = ceil(load_bound * (total load + 1) / n). So no endpoint ever holds
more than `load_bound` x the mean (rounded up), and one hot prefix spreads to
other replicas as soon as its home reaches that bound. The least-loaded
endpoint always passes, so the filter never empties the set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

from kubellm.gateway.routing.scorers.base import Candidate


def capacity(loads: Sequence[float], load_bound: float) -> float:
    return math.ceil(load_bound * (sum(loads) + 1) / max(1, len(loads)))


def within_bound(candidates: Sequence[Candidate], load_bound: float) -> list[Candidate]:
    if not candidates:
        return []
    cap = capacity([c.load for c in candidates], load_bound)
    kept = [c for c in candidates if c.load + 1 <= cap]
    return kept or [min(candidates, key=lambda c: c.load)]


Filter = Callable[[Sequence[Candidate], float], list[Candidate]]


def within_bound_or_holding(held: Collection[str], slack: float) -> Filter:
    """The bounded-load filter, widened for the replicas in `held` (they hold the prompt's
    prefix): those may take the request up to `slack` x the bound. A spill off the prefix's
    holder costs a full prefill elsewhere and copies the prefix into a second replica's
    cache, evicting other prefixes there; under cache pressure that copy is what the fleet
    loses most hits to (python -m bench.gateway_routing --workloads precise)."""

    def keep(candidates: Sequence[Candidate], load_bound: float) -> list[Candidate]:
        within = {c.url for c in within_bound(candidates, load_bound)}
        wide = capacity([c.load for c in candidates], load_bound * slack)
        return [c for c in candidates if c.url in within or (c.url in held and c.load + 1 <= wide)]

    return keep
