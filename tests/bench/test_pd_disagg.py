"""bench/simulation/pd_disagg.py's simulation keeps its books: every request answered whole, the KV
held on both roles returned, a split request's prompt computed on the prefill role only."""

from __future__ import annotations

import pytest

from bench.simulation import pd_disagg as pd


@pytest.mark.parametrize(
    ("pool", "shape", "prefill", "workload"),
    [
        ("8B/H100", "aggregated", 0, "mix"),
        ("8B/H100", "always", 2, "rag"),
        ("8B/H100", "conditional", 4, "mix"),
        ("70B/4xH100", "dynamo", 2, "rag"),
    ],
)
def test_every_request_ends_whole_and_the_kv_books_balance(pool, shape, prefill, workload):
    requests = pd.workload(workload, 3.0 if pool == "8B/H100" else 0.5, 60, seed=1)
    sim = pd.Sim(pd.POOLS[pool], shape, prefill, requests, (2.0, 0.03))
    jobs = sim.run()
    assert len(jobs) == len(requests)
    assert all(j.left == 0 and j.first >= j.req.t and j.last >= j.first for j in jobs)
    assert all(r.kv == 0 and not r.running and not r.waiting for r in sim.replicas)
    split = [j for j in jobs if j.split]
    if shape in ("always", "aggregated"):
        assert len(split) == (len(jobs) if shape == "always" else 0)
    assert all(sim.replicas[j.decode_at].role == "decode" for j in split)
    assert sum(sim.reasons.values()) == (0 if shape == "aggregated" else len(jobs))


def test_goodput_is_the_rate_where_ninety_percent_meet_both_slos():
    slo = (2.0, 0.03)
    rate = pd.goodput("8B/H100", "aggregated", 0, "chat", 100, slo, 200.0)
    assert 0 < rate < 200.0
    assert pd.attained(pd.run("8B/H100", "aggregated", 0, "chat", rate, 100, slo).jobs, slo) >= 0.9
