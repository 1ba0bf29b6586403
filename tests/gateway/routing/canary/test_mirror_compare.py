"""The shadow step's answer comparison (gateway/routing/canary/mirror.py): table tests."""

from __future__ import annotations

import math

import pytest
from kubellm.gateway.routing.canary import mirror

A = ["The", " cat", " sat", " on", " the", " mat"]
B = [*A[:3], " lay", *A[4:]]  # differs from token 4


@pytest.mark.parametrize(
    ("canary", "k", "agree"),
    [
        (A, 4, True),  # identical revisions
        (B, 3, True),  # differs from token 4: the first 3 agree
        (B, 4, False),
        (A[:2], 4, False),  # a shorter answer disagrees
        (A, 100, True),  # k past both answers: the whole answers agree
    ],
)
def test_first_k_agree(canary, k, agree):
    assert mirror.first_k_agree(A, canary, k) is agree


@pytest.mark.parametrize(
    ("canary", "expected"),
    [(A, (6, 6)), (B, (6, 5)), (A[:2], (6, 2)), ([], (6, 0))],
)
def test_token_agreement(canary, expected):
    assert mirror.token_agreement(A, canary) == expected


def test_divergence_is_zero_on_identical_revisions_and_grows_with_disagreement():
    stable = [(t, math.log(0.9)) for t in A]
    same = [{t: math.log(0.9), "x": math.log(0.05)} for t in A]
    assert mirror.divergence(stable, same) == [0.0] * 6
    unsure = [{t: math.log(0.5), "x": math.log(0.4)} for t in A]
    got = mirror.divergence(stable, unsure)
    assert got == pytest.approx([math.log(0.9 / 0.5)] * 6)
    # the canary picks another token at position 2: compared up to there, not after
    other = [same[0], {"x": math.log(0.6), A[1]: math.log(0.3)}, *same[2:]]
    assert mirror.divergence(stable, other) == pytest.approx([0.0, math.log(0.9 / 0.3)])
    # the stable token missing from the canary's top: the lowest listed logprob
    missing = [{"x": math.log(0.7), "y": math.log(0.1)}]
    assert mirror.divergence(stable[:1], missing) == pytest.approx([math.log(9)])
