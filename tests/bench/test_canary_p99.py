"""bench/gateway/canary_p99's pure parts: the interleaving, the arrivals, the summary."""

from __future__ import annotations

import collections

import pytest

from bench.gateway import canary_p99


def test_each_arm_takes_each_position_equally_often() -> None:
    rounds = canary_p99.schedule(("a", "b", "c"), 6)
    assert rounds[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for position in range(3):
        assert collections.Counter(r[position] for r in rounds) == {"a": 2, "b": 2, "c": 2}


def test_arrivals_are_one_schedule_per_seed_at_the_rate() -> None:
    one = canary_p99.arrivals(20.0, 50.0, seed=3)
    assert one == canary_p99.arrivals(20.0, 50.0, seed=3)  # every arm of a round: the same
    assert one != canary_p99.arrivals(20.0, 50.0, seed=4)
    assert one == sorted(one) and one[0] > 0 and one[-1] < 50.0
    assert 900 < len(one) < 1100  # 1000 expected (Poisson: sd ~32)


def test_prompts_differ_between_windows_but_not_in_length() -> None:
    a, b = canary_p99.prompt(1, 0, 300), canary_p99.prompt(2, 0, 300)
    assert a != b and a == canary_p99.prompt(1, 0, 300)
    assert len(a.split()) == len(b.split()) == 300


def _row(off: float, off2: float, shadow: float, load: float = 3.0) -> dict[str, object]:
    def arm(p99: float, cpu: float) -> dict[str, float]:
        return {"p99": p99, "p50": p99 / 3, "cpu_ms": cpu, "canary_requests": 0.0,
                "canary_cpu_ms": 0.1}  # fmt: skip

    return {"off": arm(off, 2.0), "off2": arm(off2, 2.0), "shadow": arm(shadow, 2.5), "load": load}


def test_the_summary_takes_round_by_round_ratios_and_their_median() -> None:
    rows = [_row(0.100, 0.100, 0.103, 2.0), _row(0.200, 0.220, 0.210, 9.0),
            _row(0.120, 0.114, 0.120, 4.0)]  # fmt: skip
    summary = canary_p99.summarize(rows)
    assert summary["rounds"] == 3 and summary["load"] == [2.0, 9.0]
    assert summary["off"]["p99"] == pytest.approx(0.120)
    assert "p99_ratio" not in summary["off"]
    ratio = summary["shadow"]["p99_ratio"]
    assert ratio["each"] == pytest.approx([1.03, 1.05, 1.0])
    assert ratio["median"] == pytest.approx(1.03)
    assert (ratio["min"], ratio["max"]) == pytest.approx((1.0, 1.05))
    assert ratio["min"] <= ratio["ci95"][0] <= ratio["median"] <= ratio["ci95"][1] <= ratio["max"]
    assert summary["off2"]["p99_ratio"]["each"] == pytest.approx([1.0, 1.1, 0.95])
    assert summary["shadow"]["cpu_ms"] == pytest.approx(2.5)
    lines = canary_p99.report(summary, "shipped defaults")
    assert "shipped defaults; 3 rounds, load average 2.0-9.0" in lines[0]
    assert lines[3].startswith("| off | 120.0 ms |")
    assert "| 1.030 (1.000-1.050; " in lines[5]


def test_the_bootstrap_interval_of_identical_values_is_that_value() -> None:
    assert canary_p99.bootstrap_median([1.02] * 9) == (1.02, 1.02)
