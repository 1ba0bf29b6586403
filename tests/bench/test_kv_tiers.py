"""bench/simulation/kv_tiers.py: its cheaper token draws are the same draws, and the goodput
bisection finds the highest working set that meets the SLO."""

from __future__ import annotations

import argparse
import random

import pytest

from bench.simulation import kv_tiers


def test_tokens_are_randranges_draws() -> None:
    fast, slow = random.Random(7), random.Random(7)
    assert kv_tiers._tokens(fast, 5_000) == [slow.randrange(50_000) for _ in range(5_000)]
    assert fast.random() == slow.random()  # the stream continues where randrange's would


@pytest.mark.parametrize("knee", [0.4, 1.7, 2.2, 3.5])
def test_sweep_bisects_to_the_highest_working_set_met(monkeypatch, knee: float) -> None:
    tried: list[float] = []

    def run(args: argparse.Namespace, workload: str, contender: str) -> kv_tiers.Result:
        factor = float(workload.split("x")[1])
        tried.append(factor)
        ttft = [0.1] * 10 if factor <= knee else [0.1] * 8 + [9.0] * 2
        return kv_tiers.Result(ttft=ttft)

    monkeypatch.setattr(kv_tiers, "run", run)
    args = argparse.Namespace(contenders="tier-aware", bisections=4, sweep_seconds=10.0,
                              sweep_warmup=5.0, ttft_slo=2.0)  # fmt: skip
    found = kv_tiers.sweep(args, 0.5, 3.0)["tier-aware"]["working_set"]
    step = (3.0 - 0.5) / 2**4
    if knee >= 3.0:
        assert found == 3.0
    elif knee < 0.5:
        assert found == 0.0
    else:
        assert knee - step <= found <= knee
    assert len(tried) <= 4 + 2
