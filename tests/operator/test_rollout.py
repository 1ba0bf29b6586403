"""The canary rollout's pure parts: the analysis verdict, the replica split, the state machine,
and the gateway figures parser. Table tests: figures in, verdict out."""

from __future__ import annotations

from typing import Any

import pytest
from kubellm.operator import builders, figures, rollout
from kubellm.operator.rollout import Counters, Observation

from kubellm import api, metrics
from tests.fixtures.canary import c

ANALYSIS = api.RolloutAnalysis(minRequests=20)
SLO = api.SLO(ttftSeconds=1.0, itlSeconds=0.1, objective=0.99)


@pytest.mark.parametrize(
    ("canary", "stable", "result", "reason"),
    [
        (None, c(), "Inconclusive", "NoFigures"),
        (c(requests=19), c(), "Inconclusive", "TooFewRequests"),
        (c(requests=19, errors=19), c(), "Inconclusive", "TooFewRequests"),  # no verdict early
        (c(), c(), "Pass", "AnalysisPassed"),
        (c(requests=20), c(), "Pass", "AnalysisPassed"),  # exactly minRequests
        (c(errors=2), c(), "Pass", "AnalysisPassed"),  # 2% is the allowed margin
        (c(errors=3), c(), "Fail", "CanaryErrorRate"),
        (c(errors=6), c(errors=5), "Pass", "AnalysisPassed"),  # stable fails as often
        (c(ttft=0.3), c(ttft=0.2), "Pass", "AnalysisPassed"),  # 1.5x: at the limit
        (c(ttft=0.6), c(ttft=0.2), "Fail", "CanaryTTFTRegression"),  # 3x slower steps
        (c(itl=0.15), c(itl=0.05), "Fail", "CanaryITLRegression"),
        (c(ttft=0.6), Counters(), "Inconclusive", "TooFewStableRequests"),
        (c(clients=4), c(), "Inconclusive", "TooFewClients"),
        (Counters(requests=100), c(), "Inconclusive", "NoClassFigures"),  # an old gateway
        (c(ttft=0.03), c(ttft=0.014), "Pass", "AnalysisPassed"),  # 2.1x, but 16 ms: the floor
        (c(met=90), c(met=100), "Fail", "CanarySLOBurn"),  # 10% missed: burn 10x > 2x
        (c(met=90), c(met=90), "Pass", "AnalysisPassed"),  # stable burns as fast: traffic
        # 3 of 100 missed against none: burn 3x over stable's 0x, but within the noise (the
        # difference's lower confidence bound is under 0); it failed on the point figures
        (c(met=97), c(met=100), "Pass", "AnalysisPassed"),
        (c(requests=50, met=46), c(requests=50, met=50), "Pass", "AnalysisPassed"),  # 8x, 4
        (c(requests=50, met=30), c(requests=50, met=50), "Fail", "CanarySLOBurn"),  # 40%
        (c(met=98), c(met=100), "Pass", "AnalysisPassed"),  # 2x over: at the limit
        (c(met=99), c(met=100), "Pass", "AnalysisPassed"),  # burn 1x
    ],
)
def test_analysis_verdict(canary, stable, result, reason):
    verdict = rollout.analyse(canary, stable, ANALYSIS, SLO)
    assert (verdict.result, verdict.reason) == (result, reason)
    if result == "Fail":  # the message says which knob and what was seen
        assert "spec.rollout.analysis." in verdict.message


def _lognormal(median: float, sigma: float, n: int) -> list[float]:
    """`n` answers spread as a lognormal's quantiles (no sampling noise: deterministic)."""
    import math
    from statistics import NormalDist

    return [median * math.exp(sigma * NormalDist().inv_cdf((i + 0.5) / n)) for i in range(n)]


def _ttfts(values: list[float]) -> Counters:
    from tests.fixtures.canary import detail

    n = len(values)
    short = detail({"short": (values, [0.05] * n)}, n)
    return Counters(requests=n, slo_met=n, ttft_sum=sum(values), ttft_count=n, itl_sum=0.5 * n,
                    itl_count=10 * n, detail=short)  # fmt: skip


@pytest.mark.parametrize(
    ("ratio", "sigma", "n", "result"),
    [
        # a median 1.7x stable's over 40 widely spread answers a side: over maxTTFTRatio 1.5
        # by the point ratio, and Mann-Whitney z 3.5 says "slower"; but its 95% lower bound
        # is 1.25x, inside the allowance: no evidence of a regression past 1.5x (it failed)
        (1.7, 0.6, 40, "Pass"),
        (2.0, 0.1, 40, "Fail"),  # answers close together: bound 1.6x (the buckets' step)
        (3.0, 0.6, 40, "Fail"),  # 3x slower, widely spread: bound 2.2x
        (3.0, 0.6, 12, "Fail"),  # ... on 12 answers a side, the fewest compared: 1.7x
        (1.4, 0.05, 200, "Pass"),  # surely slower, but inside the allowance
    ],
)
def test_a_latency_regression_needs_its_confidence_bound_over_the_allowance(
    ratio, sigma, n, result
):
    stable = _ttfts(_lognormal(0.2, sigma, n))
    canary = _ttfts(_lognormal(0.2 * ratio, sigma, n))
    analysis = api.RolloutAnalysis(minRequests=10, minClients=1)
    verdict = rollout.analyse(canary, stable, analysis, api.SLO(ttftSeconds=100))
    assert verdict.result == result, verdict.message
    if result == "Fail":
        assert verdict.reason == "CanaryTTFTRegression"


def test_verdict_figures_go_to_status():
    verdict = rollout.analyse(c(ttft=0.6), c(ttft=0.2), ANALYSIS, SLO)
    out = verdict.to_status("2026-01-01T00:00:00Z")
    assert {k: out["canary"][k] for k in ("requests", "errors", "sloMet", "ttftSeconds",
            "itlSeconds", "clients")} == {"requests": 100, "errors": 0, "sloMet": 100,
            "ttftSeconds": 0.6, "itlSeconds": 0.05, "clients": 10}  # fmt: skip
    short = out["canary"]["classes"]["short"]
    assert short["requests"] == 100 and 0.5 < short["ttftMedianSeconds"] < 0.7
    assert out["stable"]["ttftSeconds"] == 0.2
    api.RolloutVerdict.model_validate(out)


@pytest.mark.parametrize(
    ("total", "weight", "expected"),
    [
        (0, 10, (0, 0)),
        (1, 10, (1, 1)),  # at least one canary; stable keeps its one
        (2, 10, (2, 1)),
        (10, 10, (9, 1)),
        (10, 50, (5, 5)),
        (4, 50, (2, 2)),
        (3, 50, (2, 2)),
        (10, 0, (10, 0)),
        (10, 100, (0, 10)),
    ],
)
def test_split_follows_the_weight(total, weight, expected):
    assert rollout.split(total, weight) == expected


def test_counters_window_and_restart():
    later, earlier = c(requests=150), c(requests=100)
    assert later.minus(earlier).requests == 50
    assert earlier.minus(later).requests == 100  # a gateway restart: counts from zero
    assert Counters.from_status(later.to_status()) == later


# --------------------------------------------------------------------------- decide


def spec(**rollout_fields: Any) -> api.LLMDeploymentSpec:
    fields = {"strategy": "Canary", "steps": [{"weight": 10, "pauseSeconds": 60},
              {"weight": 50, "pauseSeconds": 60}], "analysis": {"minRequests": 20}}  # fmt: skip
    fields.update(rollout_fields)
    return api.LLMDeploymentSpec.model_validate(
        {"model": {"source": "hf://a/b"}, "replicas": 4, "slo": SLO.model_dump(), "rollout": fields}
    )


def seen(**kw: Any) -> Observation:
    defaults = dict(desired_revision="new", stable_revision="old", stable_ready=True,
                    canary_ready=False, now=1000.0)  # fmt: skip
    return Observation(**{**defaults, **kw})


def test_rolling_strategy_and_first_create_never_canary():
    rolling = spec(strategy="Rolling")
    assert rollout.decide(rolling, {}, seen()).mode == "rolling"
    first = rollout.decide(spec(), {}, seen(stable_revision=None))
    assert (first.mode, first.stable_replicas, first.canary_replicas) == ("rolling", 4, 0)
    assert first.status == {"revision": "new", "stableRevision": "new", "phase": "Stable",
                            "canaryWeight": 0}  # fmt: skip
    same = rollout.decide(spec(), first.status, seen(stable_revision="new"))
    assert same.status == first.status and same.events == []


def test_a_new_revision_starts_step_one_and_waits_for_the_canary():
    d = rollout.decide(spec(), {}, seen())
    assert (d.mode, d.stable_replicas, d.canary_replicas) == ("canary", 4, 1)
    assert d.status["phase"] == "Progressing" and d.status["step"] == 1
    assert d.status["canaryWeight"] == 10 and d.status["stepStartedAt"] is None
    assert [e[1] for e in d.events] == ["CanaryStarted"]
    # the canary is ready: the window opens, with the counters as its baseline
    counters = {"old": c(requests=500), "new": c(requests=0)}
    d = rollout.decide(spec(), d.status, seen(canary_ready=True, counters=counters))
    assert d.status["stepStartedAt"] == rollout.rfc3339(1000.0)
    assert d.status["baseline"]["old"]["requests"] == 500
    assert [e[1] for e in d.events] == ["CanaryStep"]


def _opened(now: float = 1000.0) -> dict[str, Any]:
    counters = {"old": c(requests=500), "new": c(requests=0)}
    d = rollout.decide(spec(), {}, seen())
    return rollout.decide(spec(), d.status, seen(canary_ready=True, counters=counters,
                                                 now=now)).status  # fmt: skip


def test_a_step_passes_only_after_its_pause_then_the_next_step_then_promotion():
    status = _opened()
    good = {"old": c(requests=1400), "new": c(requests=100)}
    early = rollout.decide(spec(), status, seen(canary_ready=True, counters=good, now=1030.0))
    assert early.status["step"] == 1 and early.verdict.result == "Pass"  # pause not over
    assert early.status["verdict"]["canary"]["requests"] == 100  # window = since baseline
    done = rollout.decide(spec(), early.status, seen(canary_ready=True, counters=good,
                                                     now=1061.0))  # fmt: skip
    assert done.status["step"] == 2 and done.status["canaryWeight"] == 50
    assert (done.stable_replicas, done.canary_replicas) == (2, 2)
    assert done.status["stepStartedAt"] is None  # waits for the canary at its new size
    status = rollout.decide(spec(), done.status, seen(canary_ready=True, counters=good,
                                                      now=1070.0)).status  # fmt: skip
    more = {"old": c(requests=1500), "new": c(requests=200)}
    last = rollout.decide(spec(), status, seen(canary_ready=True, counters=more, now=1131.0))
    assert last.mode == "promoting" and last.status["phase"] == "Promoting"
    assert last.status["canaryWeight"] == 100 and last.canary_replicas == 2
    assert [e[1] for e in last.events] == ["Promoting"]
    # the stable Deployment takes the revision; while it rolls the canary keeps serving
    rolling = rollout.decide(spec(), last.status, seen(stable_revision="new", stable_ready=False))
    assert (rolling.mode, rolling.canary_replicas) == ("promoting", 2)
    final = rollout.decide(spec(), rolling.status, seen(stable_revision="new", stable_ready=True))
    assert final.mode == "rolling" and final.status["phase"] == "Stable"
    assert [e[1] for e in final.events] == ["Promoted"]


def test_a_failed_analysis_rolls_back_at_once_and_stays_rolled_back():
    status = _opened()
    slow = {"old": c(requests=1400, ttft=0.2), "new": c(requests=30, ttft=0.6)}
    d = rollout.decide(spec(), status, seen(canary_ready=True, counters=slow, now=1010.0))
    assert (d.mode, d.stable_replicas, d.canary_replicas) == ("canary", 4, 0)
    assert d.status["phase"] == "RolledBack" and d.status["canaryWeight"] == 0
    assert d.rolled_back[0] == "CanaryTTFTRegression"
    assert d.events[-1][:2] == ("Warning", "RolledBack")
    again = rollout.decide(spec(), d.status, seen(canary_ready=False, now=2000.0))
    assert again.status == d.status and again.events == [] and again.canary_replicas == 0
    # a new revision starts over
    fresh = rollout.decide(spec(), d.status, seen(desired_revision="newer"))
    assert fresh.status["phase"] == "Progressing" and fresh.status["canaryRevision"] == "newer"


def test_too_few_requests_keep_the_step_waiting_past_its_pause():
    status = _opened()
    quiet = {"old": c(requests=600), "new": c(requests=5)}
    d = rollout.decide(spec(), status, seen(canary_ready=True, counters=quiet, now=5000.0))
    assert d.status["step"] == 1 and d.verdict.reason == "TooFewRequests"
    no_figures = rollout.decide(spec(), status, seen(canary_ready=True, now=5000.0))
    assert no_figures.status["step"] == 1 and no_figures.verdict.reason == "NoFigures"


def test_abort_and_promote_by_hand():
    status = _opened()
    aborted = rollout.decide(spec(), status, seen(canary_ready=True, action="abort"))
    assert aborted.status["phase"] == "RolledBack" and aborted.rolled_back[0] == "Aborted"
    assert aborted.clear_action and aborted.canary_replicas == 0
    promoted = rollout.decide(spec(), aborted.status, seen(action="promote"))
    assert promoted.mode == "promoting" and promoted.clear_action
    assert promoted.status["phase"] == "Promoting" and "rolledBackReason" not in promoted.status


def test_status_rollout_shape_is_the_api_model():
    status = _opened()
    slow = {"old": c(requests=1400, ttft=0.2), "new": c(requests=30, ttft=0.6)}
    d = rollout.decide(spec(), status, seen(canary_ready=True, counters=slow, now=1010.0))
    parsed = api.RolloutStatus.model_validate(d.status)
    assert parsed.rolled_back_reason == "CanaryTTFTRegression"
    assert parsed.verdict is not None and parsed.verdict.canary.ttft_seconds == 0.6


# --------------------------------------------------------------------------- builders


def test_canary_children_carry_the_revision_and_a_selector_apart_from_stable():
    llmd = api.LLMDeployment.model_validate(
        {"apiVersion": api.API_VERSION, "kind": api.KIND,
         "metadata": {"name": "m", "namespace": "ns"}, "spec": spec().model_dump(by_alias=True)}
    )  # fmt: skip
    configmap, deployment, service = builders.build_canary(llmd, 3)
    revision = builders.spec_hash(llmd)
    assert configmap["metadata"]["name"] == "m-engine-spec-canary"
    assert deployment["metadata"]["name"] == service["metadata"]["name"] == "m-engine-canary"
    assert deployment["spec"]["replicas"] == 3
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector["kubellm.io/track"] == "canary" and service["spec"]["selector"] == selector
    template = deployment["spec"]["template"]["metadata"]
    assert template["labels"]["kubellm.io/revision"] == revision
    assert template["annotations"]["kubellm.io/spec-hash"] == revision
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "engine-spec", "configMap": {"name": "m-engine-spec-canary"}} in volumes
    # the EndpointSlices copy the Service's labels: the gateway reads the revision there
    assert service["metadata"]["labels"]["kubellm.io/revision"] == revision
    assert service["metadata"]["labels"]["kubellm.io/deployment"] == "m"
    stable = builders.engine_deployment(llmd)
    assert "kubellm.io/track" not in stable["spec"]["selector"]["matchLabels"]


def test_canary_children_pass_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    llmd = api.LLMDeployment.model_validate(
        {"apiVersion": api.API_VERSION, "kind": api.KIND,
         "metadata": {"name": "m", "namespace": "ns"}, "spec": spec().model_dump(by_alias=True)}
    )  # fmt: skip
    for obj in builders.build_canary(llmd, 2, builders.Options(owner_uid="u")):
        kubernetes_validate.validate(obj, "1.32", strict=True)


# --------------------------------------------------------------------------- gateway figures


def test_gateway_figures_parse_per_revision():
    text = "\n".join(
        [
            f"# TYPE {metrics.GATEWAY_REVISION_REQUESTS[:-6]} counter",
            f'{metrics.GATEWAY_REVISION_REQUESTS}{{model="m",namespace="ns",revision="a",'
            'outcome="ok"} 90',
            f'{metrics.GATEWAY_REVISION_REQUESTS}{{model="m",namespace="ns",revision="a",'
            'outcome="error"} 10',
            f'{metrics.GATEWAY_REVISION_REQUESTS}{{model="other",namespace="ns",revision="a",'
            'outcome="ok"} 7',
            f"# TYPE {metrics.GATEWAY_REVISION_TTFT} histogram",
            f'{metrics.GATEWAY_REVISION_TTFT}_bucket{{model="m",namespace="ns",revision="a",'
            'le="+Inf"} 90',
            f'{metrics.GATEWAY_REVISION_TTFT}_sum{{model="m",namespace="ns",revision="a"}} 18',
            f'{metrics.GATEWAY_REVISION_TTFT}_count{{model="m",namespace="ns",revision="a"}} 90',
            "",
        ]
    )
    parsed = figures.parse(text, "m", "ns")
    assert set(parsed) == {"a"}
    assert (parsed["a"].requests, parsed["a"].errors) == (100, 10)
    assert parsed["a"].ttft == pytest.approx(0.2)
    assert figures.merge([parsed, parsed])["a"].requests == 200


def test_the_status_patch_removes_rollout_fields_that_are_gone():
    from kubellm.operator import status

    old = {"rollout": {"phase": "Progressing", "stepStartedAt": "t", "verdict": {"result": "Pass",
           "canary": {"requests": 3}}, "canaryWeight": 10}}  # fmt: skip
    new = {"rollout": {"phase": "Progressing", "verdict": {"result": "Inconclusive"},
                       "canaryWeight": 10}}  # fmt: skip
    patch = status.status_patch(new, old)
    # a JSON merge patch: nulls delete, so the stored status ends up equal to `new`
    verdict = {"result": "Inconclusive", "canary": None}
    assert patch == {"rollout": {"stepStartedAt": None, "verdict": verdict}}
    assert status.status_patch(new, new) is None


def _vector(*rows: tuple[dict[str, str], float]) -> dict[str, Any]:
    result = [{"metric": labels, "value": [1700000000.0, str(v)]} for labels, v in rows]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


def test_prometheus_queries_sum_over_gateway_replicas_per_revision():
    queries = figures.prometheus_queries("ns", 'm"x')
    assert queries["requests"] == (
        f"sum by (revision, outcome) ({metrics.GATEWAY_REVISION_REQUESTS}"
        '{namespace="ns",model="m\\"x"})'
    )
    assert queries["ttft_sum"].startswith(f"sum by (revision) ({metrics.GATEWAY_REVISION_TTFT}_sum")
    answers = {key: _vector() for key in queries}
    answers["requests"] = _vector(({"revision": "a", "outcome": "ok"}, 90),
                                  ({"revision": "a", "outcome": "error"}, 10),
                                  ({"outcome": "ok"}, 5))  # fmt: skip
    answers["ttft_sum"] = _vector(({"revision": "a"}, 18))
    answers["ttft_count"] = _vector(({"revision": "a"}, 90))
    parsed = figures.from_prometheus(answers)
    assert (parsed["a"].requests, parsed["a"].errors) == (100, 10)
    assert parsed["a"].ttft == pytest.approx(0.2)
    with pytest.raises(ValueError, match="no vector"):
        figures.from_prometheus({"requests": {"status": "error"}})


async def test_prometheus_figures_over_http_and_a_broken_server():
    import httpx

    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        query = request.url.params["query"]
        asked.append(query)
        if "revision_requests_total" in query:
            return httpx.Response(200, json=_vector(({"revision": "c", "outcome": "ok"}, 7)))
        return httpx.Response(200, json=_vector())

    source = figures.PrometheusFigures("http://prometheus.invalid:9090/")
    source.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    got = await source("ns", "d", "m")
    assert got is not None and got["c"].requests == 7
    assert len(asked) == len(figures.prometheus_queries("ns", "m"))
    source.http = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: httpx.Response(200, text="<html>"))
    )
    assert await source("ns", "d", "m") is None  # the step waits; nothing raises
    await source.aclose()


# --------------------------------------------------------------------------- the shadow step

SHADOW = {"steps": [{"weight": 0, "pauseSeconds": 60}, {"weight": 10, "pauseSeconds": 60}],
          "shadow": {"share": 0.1}, "analysis": {"minRequests": 20, "minClassRequests": 1,
          "quality": {"minMirroredRequests": 40}}}  # fmt: skip


def test_a_shadow_step_needs_the_mirror_and_the_quality_gate():
    assert spec(**SHADOW).rollout.steps[0].weight == 0
    for missing in ({"shadow": None}, {"analysis": {"minRequests": 20}}):
        with pytest.raises(ValueError, match="weight 0"):
            spec(**{**SHADOW, **missing})


def test_a_shadow_step_judges_the_mirror_before_any_real_traffic():
    from tests.operator.test_canary_attacks import mirrored, with_mirror

    d = rollout.decide(spec(**SHADOW), {}, seen())
    assert (d.stable_replicas, d.canary_replicas) == (4, 1)  # the whole fleet + one canary
    assert d.status["canaryWeight"] == 0 and d.status["shadow"]["share"] == 0.1
    opened = rollout.decide(spec(**SHADOW), d.status, seen(canary_ready=True, counters={
        "old": c(requests=500), "new": Counters()})).status  # fmt: skip
    # the canary answered no request: the quality gate alone decides
    few = {"old": c(requests=900), "new": with_mirror(Counters(), mirrored(20, 20))}
    wait = rollout.decide(spec(**SHADOW), opened, seen(canary_ready=True, counters=few,
                                                         now=1100.0))  # fmt: skip
    assert (wait.status["step"], wait.verdict.reason) == (1, "TooFewMirroredRequests")
    bad = {"old": c(requests=900), "new": with_mirror(Counters(), mirrored(40, 10))}
    rolled = rollout.decide(spec(**SHADOW), opened, seen(canary_ready=True, counters=bad))
    assert rolled.status["phase"] == "RolledBack" and rolled.canary_replicas == 0
    assert rolled.rolled_back[0] == "CanaryAnswersDiffer"
    good = {"old": c(requests=900), "new": with_mirror(Counters(), mirrored(40, 40))}
    early = rollout.decide(spec(**SHADOW), opened, seen(canary_ready=True, counters=good,
                                                          now=1030.0))  # fmt: skip
    assert (early.verdict.result, early.status["step"]) == ("Pass", 1)
    assert "40 mirrored requests" in early.verdict.message
    nxt = rollout.decide(spec(**SHADOW), early.status, seen(canary_ready=True, counters=good,
                                                              now=1061.0))  # fmt: skip
    assert nxt.status["step"] == 2 and nxt.status["canaryWeight"] == 10
    # past the shadow step the gateways stop mirroring (mirrors would load the canary's
    # replicas alone, against its latency checks) and the quality gate is not asked again
    assert "shadow" not in nxt.status
    zero = {"old": Counters(), "new": Counters()}  # the step's window opens on these
    real = rollout.decide(spec(**SHADOW), nxt.status, seen(canary_ready=True, counters=zero,
                                                             now=1062.0)).status  # fmt: skip
    served = {"old": c(requests=900), "new": c(requests=100)}  # no mirrored request
    judged = rollout.decide(spec(**SHADOW), real, seen(canary_ready=True, counters=served,
                                                         now=1200.0))  # fmt: skip
    assert judged.mode == "promoting", judged.status  # the last step passed, unmirrored
    assert "no significant regression" in judged.status["message"]


def test_without_a_shadow_step_every_step_mirrors_and_is_judged_on_quality():
    steps = [{"weight": 10, "pauseSeconds": 60}]
    alone = {**SHADOW, "steps": steps}
    d = rollout.decide(spec(**alone), {}, seen(canary_ready=True, counters={
        "old": c(requests=500), "new": Counters()}))  # fmt: skip
    assert d.status["shadow"]["share"] == 0.1
    served = {"old": c(requests=900), "new": c(requests=100)}  # no mirrored request yet
    wait = rollout.decide(spec(**alone), d.status, seen(canary_ready=True, counters=served,
                                                          now=1200.0))  # fmt: skip
    assert wait.verdict.reason == "TooFewMirroredRequests"
