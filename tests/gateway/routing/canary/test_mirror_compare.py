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


R = "The cat sat on the mat"


@pytest.mark.parametrize(
    ("canary", "k", "limit", "expected"),
    [
        (A, 4, 12, (True, 6, 6)),  # the same text, token by token
        (B, 3, 12, (True, 6, 3)),  # differs from token 4: past it, nothing agrees
        (B, 4, 12, (False, 6, 3)),
        (A[:2], 4, 12, (False, 3, 2)),  # stopped early where stable went on
        (A[:2], 4, 2, (False, 2, 2)),  # asked for 2 only: agrees on them, not on k
        (A, 100, 200, (True, 6, 6)),  # shorter than k: the whole answer
        ([*A, "!"], 100, 200, (False, 7, 6)),  # one token more than stable's answer
        (["The", " c", "at"], 2, 12, (True, 4, 3)),  # tokens cut otherwise: by text
        ([], 4, 12, (False, 1, 0)),
    ],
)
def test_text_agreement_lays_the_canary_tokens_along_the_clients_answer(canary, k, limit, expected):
    assert mirror.text_agreement(R, canary, k, limit) == expected


@pytest.mark.parametrize(
    ("body", "path", "expected"),
    [
        ({"temperature": 0}, "/v1/completions", True),
        ({"temperature": 0.0, "stream": True}, "/v1/chat/completions", True),
        ({"temperature": 0.7, "seed": 3}, "/v1/chat/completions", True),  # seeded
        ({}, "/v1/chat/completions", False),  # the engine's default sampling
        ({"temperature": 0.7}, "/v1/completions", False),
        ({"temperature": 0, "n": 2}, "/v1/completions", False),
        ({"temperature": 0, "prompt": ["a", "b"]}, "/v1/completions", False),
        ({"temperature": 0, "best_of": 3}, "/v1/completions", False),
        ({"seed": True}, "/v1/completions", False),
        ({"temperature": False}, "/v1/completions", False),
    ],
)
def test_reusable(body, path, expected):
    assert mirror.reusable(body, path) is expected
