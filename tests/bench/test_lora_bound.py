"""What bench/gateway/lora_routing.py prints as possible before it measures: the expected slot
loads of adapter-blind routing and of the ideal placement, checked against closed forms."""

from __future__ import annotations

import math

import pytest

from bench.gateway import lora_routing as bench


@pytest.mark.parametrize(("n", "slots"), [(4, 1), (6, 2), (12, 2)])
def test_lru_misses_under_uniform_requests_are_one_minus_slots_over_items(
    n: int, slots: int
) -> None:
    assert bench.lru_miss_rate([1 / n] * n, slots) == pytest.approx(1 - slots / n)


def test_lru_with_room_for_all_never_misses_and_a_hot_item_lowers_misses() -> None:
    assert bench.lru_miss_rate([0.5, 0.5], 2) == pytest.approx(0.0)
    skewed = bench.zipf_weights(6, 1.0)
    assert bench.lru_miss_rate(skewed, 2) < bench.lru_miss_rate([1 / 6] * 6, 2)


def test_a_swap_slot_misses_unless_the_last_request_was_the_same_adapter() -> None:
    assert bench.swap_misses([0.25] * 4, [0, 1, 2, 3]) == pytest.approx(0.75)
    assert bench.swap_misses([0.3, 0.7], [0]) == pytest.approx(0.0)


def test_the_ideal_placement_keeps_the_hottest_and_swaps_the_rest() -> None:
    p = bench.zipf_weights(12, 1.0)
    free, how = bench.best_placement(p, 4, 2, None)
    assert free == pytest.approx(bench.swap_misses(p, list(range(7, 12))))  # A0 on 8 slots
    assert "swapping #8,#9,#10,#11,#12" in how
    bounded, how = bench.best_placement(p, 4, 2, 1.25)
    assert bounded > free and "#1x2" in how  # the hottest takes two replicas' slots
    assert bench.plan_misses(p, 4, 2, 1.25) == pytest.approx(bounded)  # the gateway's plan
    blind = bench.lru_miss_rate(p, 2)
    assert blind / bounded < 5 < blind / free  # why 5x fewer loads is out of reach at 1.25
    assert math.isinf(bench.best_placement(p, 1, 1, 0.5)[0])  # nothing fits the bound
