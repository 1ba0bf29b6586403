"""Compose filters and weighted scorers into a picker, one profile per routing policy.

score(endpoint) = sum(weight_i * scorer_i(endpoint)); candidates are returned
best first (ties broken at random), so the proxy can retry down the list. A scorer whose
score is a pure function of the request and the candidates says so (`stateless = True`):
where the filters keep one candidate it is not asked (its score cannot change the order).

The profiles (which filters and scorers, with which weights, per policy) are declared
in `routing/profiles.py`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest, Scorer

# A filter keeps a subset of the candidates it is given (never one it was not given).
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
    if len(kept) == 1:
        # One kept candidate is first whatever it scores: a stateless scorer's score
        # cannot change the order, so only a scorer that keeps state (round robin's
        # turn) is asked; the tie-break is drawn once, as the sort below would draw it.
        for scorer, _ in profile.scorers:
            if not getattr(scorer, "stateless", False):
                scorer.score(request, kept)
        rng.random()
        best = kept
    else:
        totals = [0.0] * len(kept)
        for scorer, weight in profile.scorers:
            for i, value in enumerate(scorer.score(request, kept)):
                totals[i] += weight * value
        ranked = sorted(range(len(kept)), key=lambda i: (-totals[i], rng.random()))
        best = [kept[i] for i in ranked]
    if len(best) == len(candidates):  # the filters keep a subset: none was left out
        return best
    chosen = {c.url for c in best}
    rest = sorted((c for c in candidates if c.url not in chosen), key=lambda c: c.load)
    return best + rest
