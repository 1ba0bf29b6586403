"""The simulation behind bench/slo_routing.py: a replica that slows down mid-run loses its
share of requests within a minute of simulated time under slo-aware (not under
least-load), and the 90%-rate is read off a sweep as the bench defines it."""

from __future__ import annotations

import pytest
from kubellm.engine import sim_profiles

from bench._slo.fleet import Fleet, workload
from bench.slo_routing import goodput_at, rate_at
from kubellm import api

H100 = sim_profiles.get("llama-3.1-8b-h100")
SLO = api.SLO(ttftSeconds=1.0, itlSeconds=0.05)
RATE, SLOW_AT, END = 12.0, 30.0, 90.0


def _shares(policy: str) -> tuple[float, float]:
    """Replica 3's share of requests before it slows (2x, at SLOW_AT) and in the minute
    after."""
    jobs = workload(RATE, int(RATE * END), seed=3)
    fleet = Fleet([H100] * 4, policy, SLO, seed=3, changes=[(SLOW_AT, 3, H100.slowed(2.0))])
    outcomes = fleet.run(jobs).outcomes

    def share(start: float, end: float) -> float:
        sent = [o for o in outcomes if start <= o.sent < end]
        return sum(1 for o in sent if o.replica == 3) / len(sent)

    return share(0.0, SLOW_AT), share(SLOW_AT, SLOW_AT + 60.0)


def test_a_replica_that_slows_down_loses_its_share_within_a_minute() -> None:
    before, after = _shares("slo-aware")
    assert 0.15 < before < 0.35  # a fair share while all four are alike
    assert after < 0.4 * before
    blind_before, blind_after = _shares("least-load")  # the same run, load alone
    assert blind_after > 0.4 * blind_before


@pytest.mark.parametrize(
    ("shares", "expected"),
    [
        ([1.0, 0.95, 0.85], 40 + 10 * 0.05 / 0.10),  # interpolated between 40 and 50
        ([1.0, 0.95, 0.92], 50.0),  # never below: the sweep's last rate
        ([0.5, 0.4, 0.3], 0.0),  # never above
    ],
)
def test_the_90_percent_rate_is_interpolated(shares: list[float], expected: float) -> None:
    points = [{"rate": r, "slo_share": s} for r, s in zip((30.0, 40.0, 50.0), shares, strict=True)]
    assert rate_at(points) == pytest.approx(expected)


def test_goodput_past_the_knee_is_interpolated_within_the_sweep_only() -> None:
    points = [{"rate": 40.0, "goodput_rps": 39.0}, {"rate": 60.0, "goodput_rps": 45.0}]
    assert goodput_at(points, 50.0) == pytest.approx(42.0)
    assert goodput_at(points, 70.0) is None
