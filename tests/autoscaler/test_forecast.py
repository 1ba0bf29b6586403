"""The trend forecast (spec.autoscaling.predictive): growth over two model loads, not jumps."""

from __future__ import annotations

import math
import random

import pytest
from kubellm.autoscaler import forecast

NOW = 1_800_000_000.0


def history(rate, now: float = NOW, span: float = 300.0, period: float = 5.0, seed: int = 0):
    """(time, admitted so far) every period, with Poisson counts of `rate(t)` per period."""
    rng = random.Random(seed)
    samples, count, t = [], 0.0, now - span
    while t <= now + 1e-9:
        samples.append((t, count))
        mean = sum(rate(t + 0.25 + 0.5 * i) * 0.5 for i in range(int(period * 2)))
        count += _poisson(rng, mean)
        t += period
    return samples


def _poisson(rng: random.Random, mean: float) -> int:
    if mean > 30:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k


def ramp(t: float) -> float:  # the step trace's ramp: 2.1 -> 28 req/s over 432 s
    return 2.1 + 25.9 * (t - NOW + 250.0) / 432.0


def test_a_steady_ramp_is_forecast_one_model_load_ahead() -> None:
    hits = [forecast.trend(history(ramp, seed=s), NOW, 60.0) for s in range(20)]
    found = [h for h in hits if h is not None]
    assert len(found) >= 18
    expected = ramp(NOW + 60.0)  # 20.7 req/s, against 17.1 now
    assert sum(found) / len(found) == pytest.approx(expected, rel=0.1)


@pytest.mark.parametrize("since", [5.0, 10.0, 30.0, 60.0, 90.0, 115.0])
def test_a_step_is_no_trend(since: float) -> None:
    # 3.5 -> 24.5 req/s `since` seconds ago: a surprise the past cannot tell
    def step(t: float) -> float:
        return 3.5 if t < NOW - since else 24.5

    assert all(forecast.trend(history(step, seed=s), NOW, 60.0) is None for s in range(10))


def test_a_burst_is_no_trend() -> None:
    def burst(t: float) -> float:
        return 30.0 if NOW - 40 <= t < NOW - 10 else 14.0

    assert all(forecast.trend(history(burst, seed=s), NOW, 60.0) is None for s in range(10))


def test_steady_load_is_no_trend() -> None:
    found = [forecast.trend(history(lambda t: 20.0, seed=s), NOW, 60.0) for s in range(300)]
    assert sum(1 for f in found if f is not None) <= 3  # z = 3: about one period an hour


def test_falling_load_is_no_trend() -> None:
    def falling(t: float) -> float:
        return 28.0 - 25.9 * (t - NOW + 250.0) / 432.0

    assert all(forecast.trend(history(falling, seed=s), NOW, 60.0) is None for s in range(10))


def test_too_little_history_or_a_restarted_counter_is_no_forecast() -> None:
    samples = history(ramp)
    assert forecast.trend(samples[-10:], NOW, 60.0) is None  # 45 s of a 120 s fit
    restarted = [*samples[:-3], *((t, 0.0) for t, _ in samples[-3:])]
    assert forecast.trend(restarted, NOW, 60.0) is None
    assert forecast.trend(samples, NOW, 0.0) is None
    assert forecast.fit_seconds(60.0) == 120.0 and forecast.fit_seconds(5.0) == 30.0
