"""bench/autoscaler/fluid_bound.py's reactive fleet on rate curves whose answer is known."""

from __future__ import annotations

from bench.autoscaler import fluid_bound


def test_a_flat_load_within_the_fleet_misses_nothing_and_pays_the_oracle() -> None:
    missed, paid = fluid_bound.fleet([13.0] * 600, 7.0, 0.0, 300.0, 60.0, 10.0)
    assert missed == 0 and paid == 2 * 600


def test_a_step_is_missed_while_replicas_load_and_the_hold_pays_after_it() -> None:
    rates = [7.0] * 100 + [35.0] * 100 + [7.0] * 400
    missed, paid = fluid_bound.fleet(rates, 7.0, 0.0, 300.0, 60.0, 10.0)
    # seen 5 s late, ready 60 s later: 35 - 7 - 10 req/s short for 60-65 s
    assert 18 * 60 <= missed <= 18 * 66
    without_hold = fluid_bound.fleet(rates, 7.0, 0.0, 0.0, 60.0, 10.0)[1]
    assert paid > without_hold  # the window keeps the fleet up after the step
