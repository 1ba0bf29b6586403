"""Issue 39 items 15-16: one client must not decide a rollout. Each attack is played through
the gateway's own counting (gateway/routing/latency/metrics.py: per-class histograms, the per-client
cap, distinct clients), read back as the operator does (operator/figures.py), and judged by
the pure verdict (operator/rollout.py). Each test also shows the figures the old verdict
(a ratio of means over every answer) would have judged wrongly."""

from __future__ import annotations

import random
from collections import Counter as Tally

from kubellm.gateway.routing.canary import revisions
from kubellm.gateway.routing.latency import metrics as slo
from kubellm.gateway.routing.scorers.base import RoutingRequest
from kubellm.operator import figures, rollout
from prometheus_client import generate_latest

from kubellm import api

ANALYSIS = api.RolloutAnalysis(minRequests=50)
SLO = api.SLO(ttftSeconds=2.0, itlSeconds=0.2, objective=0.99)
LABELS = ("m", "d", "ns")


class Gateway:
    """The gateway's per-revision counting, fed answers directly."""

    def __init__(self) -> None:
        self.metrics = slo.create()
        self.series = slo.TargetMetrics(self.metrics, LABELS)

    def answer(self, revision: str, client: str, chars: int, ttft: float, *,
               streamed: bool = True, tokens: int = 20, tpot: float = 0.02) -> None:  # fmt: skip
        record = slo.RequestRecord(self.series, 0.0)
        record.revision = revision
        step = ("m", revision, "new", 10)
        record.sample = (step, client, revisions.size_class(chars))
        record.finish("replica", 200)
        gaps = [tpot] * (tokens - 1) if streamed else []
        record.revision_observed(ttft, gaps, met=True, streamed=streamed)

    def counters(self) -> dict[str, rollout.Counters]:
        return figures.parse(generate_latest(self.metrics.registry).decode(), "m", "ns")


def honest(gateway: Gateway, canary_ttft: float = 0.2, stable_ttft: float = 0.2,
           clients: int = 40, seed: int = 1) -> None:  # fmt: skip
    """40 clients, 5 short streamed requests each, one in ten on the canary (by client)."""
    rng = random.Random(seed)
    for i in range(clients):
        side, base = ("new", canary_ttft) if i % 10 == 0 else ("stable", stable_ttft)
        for _ in range(5):
            gateway.answer(side, f"c{i}", 500, base * rng.uniform(0.8, 1.25))


def verdict(gateway: Gateway) -> rollout.Verdict:
    got = gateway.counters()
    return rollout.analyse(got["new"], got["stable"], ANALYSIS, SLO)


def test_long_non_streamed_requests_hashed_into_the_canary_do_not_roll_a_good_one_back():
    gateway = Gateway()
    honest(gateway, clients=100)
    for _ in range(3):  # the attacker: three long prompts, not streamed, 20 s each
        gateway.answer("new", "attacker", 40_000, 20.0, streamed=False)
    got = gateway.counters()
    assert got["new"].ttft / got["stable"].ttft > 1.5  # the mean-of-all ratio: rolled back
    assert (verdict(gateway).result, verdict(gateway).reason) == ("Pass", "AnalysisPassed")


def test_loading_the_stable_side_does_not_pass_a_slow_canary():
    gateway = Gateway()
    honest(gateway, canary_ttft=0.6, stable_ttft=0.2, clients=100)  # the canary is 3x slower
    for _ in range(300):  # one client floods the stable side with slow short prompts
        gateway.answer("stable", "attacker", 500, 3.0)
    got = gateway.counters()
    assert got["new"].ttft / got["stable"].ttft < 1.5  # the mean-of-all ratio: passed
    assert verdict(gateway).reason == "CanaryTTFTRegression"


def test_a_few_ms_on_a_loaded_machine_is_no_regression():
    gateway = Gateway()
    honest(gateway, canary_ttft=0.033, stable_ttft=0.014, clients=100)  # 2.4x, 19 ms
    assert verdict(gateway).result == "Pass"


def test_one_client_alone_never_decides():
    gateway = Gateway()
    for i in range(200):
        gateway.answer("stable", "alice", 500, 0.2)
        if i < 60:
            gateway.answer("new", "alice", 500, 2.0)  # slow, but one client's word only
    assert verdict(gateway).reason == "TooFewClients"


def test_one_client_weighs_at_most_its_cap():
    gateway = Gateway()
    honest(gateway, clients=100)
    for _ in range(200):  # one client's 200 slow streamed answers on the canary
        gateway.answer("new", "attacker", 500, 5.0)
    got = gateway.counters()
    assert got["new"].histogram("stream_ttft", "short")[float("inf")] == 50 + slo.CLIENT_CAP
    assert verdict(gateway).result == "Pass"


def test_a_class_the_canary_never_saw_keeps_the_verdict_inconclusive():
    gateway = Gateway()
    honest(gateway, clients=100)
    for i in range(100):  # long prompts: all on stable (one shared system prompt's key)
        gateway.answer("stable", f"l{i}", 40_000, 1.0)
    assert verdict(gateway).reason == "ClassNotCovered"


def test_a_hot_system_prompt_splits_by_weight_instead_of_moving_as_one():
    # 400 long prompts behind one system prompt (the same first chunk): by the old key (the
    # prompt's home) all 400 went to one side; each prompt is its own key now
    requests = [RoutingRequest("m", chunk_hashes=(7, 1000 + i), affinity_key=7)
                for i in range(400)]  # fmt: skip
    sides = Tally(revisions.to_canary(revisions.request_key(r), 10) for r in requests)
    assert 20 <= sides[True] <= 60
    session = RoutingRequest("m", chunk_hashes=(7, 8), affinity_key=7, session="s")
    assert revisions.request_key(session) == "session:s"  # a session still sticks


QUALITY = api.RolloutAnalysis.model_validate({"minRequests": 20, "quality": {
    "minMirroredRequests": 40, "minAgreement": 0.9, "maxDivergence": 0.1}})  # fmt: skip


def mirrored(
    n: int, agreed: int, size: str = "short", div: float = 0.0, tokens_agreed: float = 1.0
) -> dict[str, float]:
    return {f"mirrored|{size}": n, f"agreed|{size}": agreed, "tokens": n * 16.0,
            "tokens_agreed": tokens_agreed * n * 16.0, "divergence_sum": div * n * 16,
            "divergence_count": n * 16.0}  # fmt: skip


def with_mirror(counters: rollout.Counters, extra: dict[str, float]) -> rollout.Counters:
    return rollout.Counters(**{**counters.__dict__, "detail": {**counters.detail, **extra}})


def test_quality_gate_verdicts():
    from tests.fixtures.canary import c

    stable = c(requests=500)
    cases = [
        ({}, "Inconclusive", "TooFewMirroredRequests"),
        (mirrored(39, 39), "Inconclusive", "TooFewMirroredRequests"),
        (mirrored(100, 100), "Pass", "AnalysisPassed"),  # identical revisions
        (mirrored(100, 88), "Pass", "AnalysisPassed"),  # 88% could be 90%: not proven worse
        (mirrored(100, 100, tokens_agreed=0.8), "Fail", "CanaryTokensDiffer"),
        (mirrored(400, 284), "Fail", "CanaryAnswersDiffer"),  # 71% of 400
        (mirrored(100, 100, div=0.5), "Fail", "CanaryDiverges"),
        (mirrored(100, 100, size="long"), "Inconclusive", "ClassNotMirrored"),
    ]
    for extra, result, reason in cases:
        got = rollout.analyse(with_mirror(c(), extra), stable, QUALITY, SLO)
        assert (got.result, got.reason) == (result, reason), extra
    got = rollout.analyse(with_mirror(c(), mirrored(400, 284)), stable, QUALITY, SLO)
    assert "agreement 71% < 90% on 400 mirrored requests" in got.message
    assert got.to_status("t")["canary"]["agreement"] == 0.71
    api.RolloutVerdict.model_validate(got.to_status("t"))


def test_prompts_sharing_a_system_prompt_and_differing_in_a_short_tail_split_too():
    # the prefix chunks leave a short tail out: the key is the whole prompt's text
    system = "You are the assistant of a long shared system prompt. " * 40
    from kubellm.gateway.routing.router import routing_request

    keys = {
        revisions.request_key(routing_request("m", {"messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {i}"}]}, None))
        for i in range(200)
    }  # fmt: skip
    assert len(keys) == 200
    assert 5 <= sum(revisions.to_canary(k, 10) for k in keys) <= 40
