"""The simulation behind bench/gateway/slo_routing.py: a replica that slows down mid-run loses its
share of requests within a minute of simulated time under slo-aware (not under
least-load), and the 90%-rate is read off a sweep as the bench defines it."""

from __future__ import annotations

import pytest
from kubellm.engine import sim_profiles

from bench.gateway._slo.fleet import CHARS_PER_TOKEN, Fleet, Job, workload
from bench.gateway.slo_routing import capacity, goodput_at, rate_at
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


def test_the_capacity_bound_counts_uncached_prefill_answers_and_the_step_base() -> None:
    """Two jobs on one replica: 100 unique prompt tokens and 10 answer tokens, and a 1,000-
    token shared system prompt (cached) before 20 unique tokens and 30 answer tokens. Work:
    100 x 1 ms + 10 x 2 ms = 120 ms, and 20 x 1 ms + 30 x 2 ms = 80 ms; a 10 ms step base
    under a 50 ms ITL leaves 80% of the time: 0.8 / 0.1 s = 8 req/s serving both, and the
    cheaper one (the cheapest 90% of two jobs is one, over both jobs' count) 0.8 / 0.04 s.
    90% in a steady state: the cheaper one within the SLO (80 ms / 0.8) and the dearer one
    served late, free of the base (120 ms): 2 jobs / 0.22 s."""
    profile = sim_profiles.Profile(
        name="test",
        block_size=16,
        num_blocks=1000,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        step_base_s=0.010,
        prefill_token_s=0.001,
        decode_token_s=0.002,
        source="test",
    )
    system = "s" * (1000 * CHARS_PER_TOKEN)
    jobs = [
        Job(0.0, "0:" + "a" * (100 * CHARS_PER_TOKEN - 2), 10),
        Job(0.1, system + "1:" + "b" * (20 * CHARS_PER_TOKEN - 2), 30),
    ]
    sustained, steady, cheapest = capacity([profile], jobs, 0.05)
    assert sustained == pytest.approx(8.0)
    assert steady == pytest.approx(2 / 0.22)
    assert cheapest == pytest.approx(20.0)
    assert capacity([profile, profile], jobs, 0.05)[0] == pytest.approx(16.0)


def test_the_present_ttft_is_exact_alone_and_never_above_the_observed_one() -> None:
    """Fleet(present=N) runs a copy of the replica forward from each N-th dispatch with
    nothing arriving after it: for requests far apart that is exactly the TTFT they get;
    in a burst later arrivals only join its steps, so it is never above the observed
    TTFT, and below it for some (what no prediction made at dispatch can know)."""
    small = H100.with_overrides(num_blocks=4000)  # a copy of the full pool takes 0.2 s
    apart = [Job(10.0 * i, f"{i}:" + "x" * (400 * CHARS_PER_TOKEN), 30) for i in range(4)]
    for o in Fleet([small] * 2, "least-load", SLO, present=1).run(apart).outcomes:
        assert o.present_ttft == pytest.approx(o.first - o.sent)
    burst = workload(100.0, 200, seed=5)
    outcomes = Fleet([small] * 2, "least-load", SLO, present=1).run(burst).outcomes
    gaps = [(o.first - o.sent) - o.present_ttft for o in outcomes]
    assert all(gap >= -1e-9 for gap in gaps)
    assert sum(gap > 1e-3 for gap in gaps) > len(gaps) // 10


def test_with_the_gateways_thresholds_a_request_waits_then_is_refused() -> None:
    """`--thresholds gateway`: with every replica saturated (here one request in flight
    each) a request waits in the gateway and is refused once its TTFT budget is spent, as
    the scheduler does without a fallback; without thresholds it goes to a replica."""
    from kubellm.gateway.routing.settings import Thresholds

    jobs = [Job(0.0, "a" * 4000, 2000), Job(0.01, "b" * 4000, 10)]
    capped = Fleet([H100], "slo-aware", SLO, thresholds=Thresholds(max_in_flight=1))
    first, second = capped.run(jobs).outcomes
    assert first.replica == 0 and first.first is not None
    assert second.replica == -1 and second.first is None  # refused: a miss
    assert second.sent >= jobs[1].arrival + SLO.ttft_seconds  # after its whole budget
    both = Fleet([H100], "slo-aware", SLO).run(jobs).outcomes
    assert [o.replica for o in both] == [0, 0]
