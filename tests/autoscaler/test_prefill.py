"""The prefill role's autoscaling decisions and the pair's coordination (pure)."""

from __future__ import annotations

import pytest
from kubellm.autoscaler.prefill import PrefillSignals, coordinate, prefill_ask, stabilised

from kubellm import api

SPEC = api.PrefillAutoscaling(minReplicas=1, maxReplicas=8, targetQueueShare=0.5)


@pytest.mark.parametrize(
    ("queued", "running", "tps", "current", "expected"),
    [
        (0, 0, 10_000, 3, 1),  # idle: down to the minimum
        (9_000, 1_000, 10_000, 1, 1),  # 10k tokens = 1 s of work; budget 0.5 x 2 s = 1 s
        (10_001, 0, 10_000, 1, 2),  # just over one replica's budget
        (45_000, 5_000, 10_000, 2, 5),  # 5 s of work over 1 s budgets
        (10**9, 0, 10_000, 2, 8),  # capped at maxReplicas
        (50_000, 0, 0, 3, 3),  # no throughput measured: hold the current count
    ],
)
def test_prefill_ask_is_queued_work_over_the_ttft_budget(queued, running, tps, current, expected):
    signals = PrefillSignals(queued, running, tps, current)
    assert prefill_ask(signals, SPEC, ttft_seconds=2.0) == expected


def test_a_tighter_ttft_budget_asks_for_more_prefill_replicas() -> None:
    signals = PrefillSignals(40_000, 0, 10_000, 1)
    assert prefill_ask(signals, SPEC, ttft_seconds=0.5) > prefill_ask(signals, SPEC, 2.0)


def test_scale_to_zero_allowed_by_the_minimum() -> None:
    spec = api.PrefillAutoscaling(minReplicas=0, maxReplicas=4)
    assert prefill_ask(PrefillSignals(0, 0, 10_000, 2), spec, 2.0) == 0


@pytest.mark.parametrize(
    ("asks", "now", "ask", "expected"),
    [
        ([], 100.0, 2, 2),
        ([(50.0, 5)], 100.0, 2, 5),  # a higher ask 50 s ago holds within a 300 s window
        ([(50.0, 5)], 400.0, 2, 2),  # past the window it no longer holds
        ([(90.0, 1)], 100.0, 3, 3),  # scale-up is at once
    ],
)
def test_scale_down_waits_for_the_window(asks, now, ask, expected) -> None:
    assert stabilised(asks, now, 300.0, ask) == expected


@pytest.mark.parametrize(
    ("decode", "prefill", "prefill_min", "expected"),
    [
        (0, 3, 1, (0, 0)),  # decode at zero: never a prefill replica alone
        (0, 0, 0, (0, 0)),
        (1, 0, 1, (1, 1)),  # decode woke from zero: prefill back to its minimum
        (4, 2, 1, (4, 2)),
        (2, 0, 0, (2, 0)),  # prefill may be zero beside decode (local prefill serves)
    ],
)
def test_the_pair_scales_to_zero_together(decode, prefill, prefill_min, expected) -> None:
    assert coordinate(decode, prefill, prefill_min) == expected
