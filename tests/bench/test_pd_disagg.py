"""bench/simulation/pd_disagg.py's simulation keeps its books: every request answered whole, the KV
held on both roles returned, a split request's prompt computed on the prefill role only."""

from __future__ import annotations

import pytest
from kubellm.gateway.discovery.base import PrefillSplit
from kubellm.gateway.routing.disagg import Inputs, decide

from bench.simulation import pd_disagg as pd
from kubellm.simulation import pd as simulation_pd


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


def test_pooled_goodput_counts_every_samples_requests_at_each_rate(monkeypatch):
    """`--seeds`: each point runs every workload sample apart, its predictions' error drawn
    with its own seed, and the share within both SLOs is over all their requests together."""
    slo, pool = (2.0, 0.03), pd.POOLS["8B/H100"]
    one = simulation_pd.goodput(pd.requests_at("chat", 100), pool, "aggregated", 0, slo, 200.0)
    assert pd.goodput("8B/H100", "aggregated", 0, "chat", 100, slo, 200.0, (0,)) == one
    runs: list[tuple[int, int]] = []
    sim = simulation_pd.Sim

    def recorded(*args, **kwargs):
        made = sim(*args, **kwargs)
        runs.append((args[7], len(args[3])))  # (the error's seed, requests)
        return made

    monkeypatch.setattr(simulation_pd, "Sim", recorded)
    rate = pd.goodput("8B/H100", "conditional", 4, "rag", 100, slo, 40.0, (0, 1, 2), error=0.3)
    assert 0 < rate < 40.0
    assert [seed for seed, _ in runs[:3]] == [0, 1, 2] and len(runs) % 3 == 0
    monkeypatch.setattr(simulation_pd, "Sim", sim)
    jobs = [j for s in (0, 1, 2) for j in pd.Sim(
        pool, "conditional", 4, pd.requests_at("rag", 100, s)(rate), slo, error=0.3, seed=s
    ).run()]  # fmt: skip
    assert pd.attained(jobs, slo) >= 0.9
    samples = [pd.requests_at("rag", 100, s)(rate) for s in (0, 1, 2)]
    assert samples[0] != samples[1] != samples[2]


# ---------------------------------------------------------------- the predictions' error


class _Constant:
    """An rng whose every prediction-error factor is `factor`."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def lognormvariate(self, _mu: float, _sigma: float) -> float:
        return self.factor


def _run(shape: str, error: float, factor: float | None = None, seed: int = 0) -> pd.Sim:
    requests = pd.workload("mix", 0.8, 80, seed=2)
    sim = pd.Sim(pd.POOLS["70B/4xH100"], shape, 2, requests, pd.SLO, error=error, seed=seed)
    if factor is not None:
        sim.rng = _Constant(factor)  # type: ignore[assignment]
    sim.run()
    return sim


def _outcome(sim: pd.Sim) -> list[tuple[float, float, bool, int]]:
    return [(j.first, j.last, j.split, j.decode_at) for j in sim.jobs]


@pytest.mark.parametrize("shape", ["conditional", "always", "dynamo"])
def test_a_factor_of_one_reproduces_exact_state(shape):
    exact = _run(shape, 0.0)
    assert _outcome(_run(shape, 0.6, factor=1.0)) == _outcome(exact)
    assert _run(shape, 0.6, factor=1.0).reasons == exact.reasons


@pytest.mark.parametrize(("error", "differs"), [(0.0, False), (0.3, True), (0.6, True)])
def test_the_error_is_seeded_and_changes_the_decisions(error, differs):
    once, again = _run("conditional", error), _run("conditional", error)
    assert _outcome(once) == _outcome(again)  # the same seed, the same draws
    assert (_outcome(once) != _outcome(_run("conditional", 0.0))) is differs
    assert (_outcome(once) != _outcome(_run("conditional", error, seed=1))) is differs


def test_the_error_scales_the_predictions_not_the_engines_costs(monkeypatch):
    seen: list[object] = []
    steps: list[tuple[float, float]] = []

    def record(inputs):
        seen.append(inputs)
        return decide(inputs)

    monkeypatch.setattr(simulation_pd, "decide", record)
    _run("conditional", 0.6, factor=1.0)
    exact = seen[0]  # the first request meets an empty fleet in every run
    seen.clear()
    sim = pd.Sim(pd.POOLS["70B/4xH100"], "conditional", 2,
                 pd.workload("mix", 0.8, 80, seed=2), pd.SLO, error=0.6)  # fmt: skip
    sim.rng = _Constant(1.5)  # type: ignore[assignment]
    push = sim.push

    def step(at: float, kind: int, arg: int) -> None:
        if kind == 1:  # a step: charged at the profile's true cost for its batch
            _, decodes, prefill = sim.current[arg]
            steps.append((at - sim.now, sim.p.step_seconds(prefill, decodes)))
        push(at, kind, arg)

    sim.push = step  # type: ignore[method-assign]
    sim.run()
    scaled = seen[0]
    for name in ("local_ttft", "decode_step_s", "others_itl", "prefill_ttft"):
        assert getattr(scaled, name) == pytest.approx(1.5 * getattr(exact, name)), name
    assert scaled.prompt_tokens == exact.prompt_tokens
    assert steps and all(t == pytest.approx(true) for t, true in steps)


def test_the_margin_has_one_default():
    args = pd.parser().parse_args([])
    assert args.margin == PrefillSplit.margin == Inputs.__dataclass_fields__["margin"].default
    assert pd.Sim(pd.POOLS["8B/H100"], "conditional", 1, [], pd.SLO).margin == args.margin
    assert args.error == simulation_pd.ERRORS["realistic"] > 0
    assert pd.parser().parse_args(["--margin", "0.05"]).margin == 0.05


def test_recording_keeps_each_decision_and_the_streams_it_saw():
    """`--harm` reads each conditional decision with the jobs decoding on its decode
    replica then; recording changes no decision."""
    requests = pd.workload("mix", 0.5, 60, seed=1)
    plain = pd.Sim(pd.POOLS["70B/4xH100"], "conditional", 3, list(requests), (2.0, 0.03))
    plain.run()
    sim = pd.Sim(pd.POOLS["70B/4xH100"], "conditional", 3, list(requests), (2.0, 0.03))
    sim.record = True
    jobs = {j.index: j for j in sim.run()}
    assert [j.split for j in sim.jobs] == [j.split for j in plain.jobs] and not plain.verdicts
    assert [i for i, *_ in sim.verdicts] == sorted(jobs)
    for i, _, verdict, there in sim.verdicts:
        assert verdict.split == jobs[i].split
        assert all(jobs[k].decode_at == jobs[i].decode_at and k < i for k in there)


def test_misses_count_every_request_of_every_sample_once(capsys):
    """`--misses`: each request in exactly one kind (where its prompt ran, which SLO it
    missed), over the pooled samples' requests."""
    pd.misses("70B/4xH100", 3, "rag:1.5", 60, (0, 1), 0.3)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "of 120;" in line
    kinds = line.split("; ")[1].split(", ")
    assert sum(int(k.rsplit(" ", 1)[1]) for k in kinds) == 120
    assert all(k.split(" ")[0] in ("local", "split") for k in kinds)
