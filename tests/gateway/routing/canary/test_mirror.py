"""The shadow step on real loopback servers (gateway/routing/canary/mirror.py): a sample of the
stable revision's requests is mirrored to the canary, compared with the stable replica's
greedy answer, counted apart, never returned to a client, and shed when the canary is busy."""

from __future__ import annotations

from dataclasses import replace

from kubellm.gateway.discovery.base import CanarySplit, Endpoint
from kubellm.gateway.routing.canary import revisions
from kubellm.gateway.routing.router import routing_request
from kubellm.operator import figures, rollout
from prometheus_client import generate_latest

from kubellm import api, metrics
from tests.fixtures.engines import wait_until
from tests.gateway.conftest import model


def _target(stable, canary, share=1.0, concurrency=4):
    return replace(
        model("tiny", [stable, canary]),
        endpoints=(Endpoint(stable.url), Endpoint(canary.url, revision="new")),
        canary=CanarySplit("new", 1, share, concurrency, 4),
    )


def _stable_prompts(count: int) -> list[list[dict[str, str]]]:
    """Prompts whose split key falls on the stable side of a 1% canary."""
    out = []
    i = 0
    while len(out) < count:
        messages = [{"role": "user", "content": f"Question {i} of the mirror test. " * 20}]
        key = revisions.request_key(routing_request("tiny", {"messages": messages}, None))
        if not revisions.to_canary(key, 1):
            out.append(messages)
        i += 1
    return out


def _text(gw) -> str:
    return generate_latest(gw.gateway.metrics.registry).decode()


def _sum(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_mirrored_answers_are_compared_and_never_reach_the_client(engines, gateway):
    (_, stable), (canary_engine, canary) = engines(2, prefix="r")
    gw = gateway({"tiny": _target(stable, canary)})
    client = gw.client()
    for messages in _stable_prompts(6):
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=50)
        assert answer.choices[0].message.content.startswith("r0")  # the stable answer only
    wait_until(lambda: _sum(_text(gw), metrics.GATEWAY_MIRROR_REQUESTS)
               + _sum(_text(gw), metrics.GATEWAY_MIRROR_SHED) >= 6, timeout=60,
               what="every mirror compared or shed")  # fmt: skip
    text = _text(gw)
    compared = _sum(text, metrics.GATEWAY_MIRROR_REQUESTS, revision="new")
    assert compared >= 1
    assert _sum(text, metrics.GATEWAY_MIRROR_AGREED) == 0  # "r1-t0" is not "r0-t0"
    shadow = canary_engine.bodies[-1]  # greedy, seeded, bounded, not streamed, logprobs
    assert (shadow["temperature"], shadow["seed"], shadow["max_tokens"]) == (0, 0, 8)
    assert shadow["stream"] is False and shadow["logprobs"] is True
    # vLLM answers 400 to a body without its content type: the mirror says it's JSON
    assert canary_engine.headers[-1].get("content-type") == "application/json"
    # counted apart: the gateway's requests and the per-revision series hold the 6 only
    assert _sum(text, metrics.GATEWAY_REQUESTS) == 6
    counted = figures.parse(text, "tiny")
    assert counted["stable"].requests == 6 and counted.get("new", rollout.Counters()).requests == 0
    quality = api.RolloutAnalysis(minRequests=1, minClients=1, minClassRequests=1,
                                  quality={"minMirroredRequests": 1})  # fmt: skip
    verdict = rollout.quality_verdict(counted["new"], counted["stable"], quality, 4)
    assert verdict is not None and verdict.reason == "CanaryAnswersDiffer"


def test_identical_revisions_agree(engines, gateway):
    (_, stable), (canary_engine, canary) = engines(2, prefix="r")
    canary_engine.name = "r0"  # the same answers as the stable engine
    gw = gateway({"tiny": _target(stable, canary)})
    client = gw.client()
    for messages in _stable_prompts(4):
        client.chat.completions.create(model="tiny", messages=messages)
    wait_until(lambda: _sum(_text(gw), metrics.GATEWAY_MIRROR_REQUESTS)
               + _sum(_text(gw), metrics.GATEWAY_MIRROR_SHED) >= 4, timeout=60,
               what="every mirror compared or shed")  # fmt: skip
    text = _text(gw)
    compared = _sum(text, metrics.GATEWAY_MIRROR_REQUESTS)
    assert compared >= 1 and _sum(text, metrics.GATEWAY_MIRROR_AGREED) == compared
    assert _sum(text, metrics.GATEWAY_MIRROR_TOKENS_AGREED) == _sum(
        text, metrics.GATEWAY_MIRROR_TOKENS
    )


def test_the_mirror_is_shed_when_the_canary_is_busy_and_the_stable_answer_waits_for_nothing(
    engines, gateway
):
    (_, stable), (canary_engine, canary) = engines(2, prefix="r")
    canary_engine.behaviour.first_byte_delay = 30.0  # the canary hangs on every mirror
    gw = gateway({"tiny": _target(stable, canary, concurrency=2)})
    client = gw.client(timeout=20)
    for messages in _stable_prompts(10):  # each answered by stable, mirrors or not
        answer = client.chat.completions.create(model="tiny", messages=messages)
        assert answer.choices[0].message.content.startswith("r0")
    text = _text(gw)
    assert gw.gateway.mirror.in_flight <= 2
    assert _sum(text, metrics.GATEWAY_MIRROR_SHED, reason="busy") >= 8
    assert len(canary_engine.bodies) <= 2


def test_mirrors_never_count_against_a_tenants_quota(engines, gateway):
    from tests.gateway.http.test_tenancy import chat, declared, within_one_minute

    (_, stable), (_, canary) = engines(2, prefix="r")
    gw = gateway({"tiny": _target(stable, canary)}, tenancy=declared())  # meter: 2 a minute
    within_one_minute()
    prompts = [m[0]["content"] for m in _stable_prompts(2)]
    assert [chat(gw, "meter", text).status_code for text in prompts] == [200, 200]
    wait_until(lambda: _sum(_text(gw), metrics.GATEWAY_MIRROR_REQUESTS) >= 1, timeout=60,
               what="a mirror compared")  # fmt: skip
    text = _text(gw)
    assert _sum(text, "kubellm_gateway_tenant_requests_total", tenant="meter") == 2
    assert _sum(text, "kubellm_gateway_tenant_throttled_total", tenant="meter") == 0


def test_a_shadow_step_mirrors_while_the_canary_takes_no_request(engines, gateway):
    (_, stable), (canary_engine, canary) = engines(2, prefix="r")
    target = _target(stable, canary)
    target = replace(target, canary=replace(target.canary, weight=0))  # the shadow step
    gw = gateway({"tiny": target})
    client = gw.client()
    for i in range(6):  # any prompt: at weight 0 none is the canary's
        messages = [{"role": "user", "content": f"Shadow step question {i}. " * 20}]
        answer = client.chat.completions.create(model="tiny", messages=messages)
        assert answer.choices[0].message.content.startswith("r0")
    wait_until(lambda: _sum(_text(gw), metrics.GATEWAY_MIRROR_REQUESTS)
               + _sum(_text(gw), metrics.GATEWAY_MIRROR_SHED) >= 6, timeout=60,
               what="every mirror compared or shed")  # fmt: skip
    text = _text(gw)
    assert _sum(text, metrics.GATEWAY_MIRROR_REQUESTS, revision="new") >= 1
    assert all(b["temperature"] == 0 for b in canary_engine.bodies)  # mirrors only
    counted = figures.parse(text, "tiny")
    assert counted.get("new", rollout.Counters()).requests == 0


def _answer(tokens: list[str], logprobs: list[float]) -> dict:
    tops = [{t: lp, "zz": lp - 3.0} for t, lp in zip(tokens, logprobs, strict=True)]
    return {"choices": [{"text": " ".join(tokens), "logprobs": {
        "tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops}}],
        "usage": {"completion_tokens": len(tokens)}}  # fmt: skip


def test_a_pair_with_logprobs_records_divergence_per_token():
    """Real engines send logprobs: each compared token's divergence is observed, and the
    answer times too (a mirror with logprobs once died before counting them)."""
    import asyncio

    from kubellm.gateway.discovery.base import ModelTarget
    from kubellm.gateway.routing.canary import mirror
    from kubellm.gateway.routing.replicas.load import LoadView
    from prometheus_client import CollectorRegistry

    answers = {"http://s": _answer(["a", "b", "c"], [-0.1, -0.2, -0.3]),
               "http://c": _answer(["a", "b", "c"], [-0.4, -0.2, -0.5])}  # fmt: skip

    async def post(url, path, body):
        return answers[url], 0.3

    target = ModelTarget("tiny", "tiny", endpoints=(Endpoint("http://s"),
                         Endpoint("http://c", revision="new")),
                         canary=CanarySplit("new", 0, 1.0, 4, 2))  # fmt: skip
    registry = CollectorRegistry()
    metrics_ = mirror.metrics_for(registry)

    async def run() -> None:
        m = mirror.Mirror(metrics_, post, LoadView())
        assert m.offer(target, "http://s", "/v1/completions", {"prompt": "x"}, 1)
        await asyncio.gather(*m.tasks)

    asyncio.run(run())
    text = generate_latest(registry).decode()
    assert _sum(text, metrics.GATEWAY_MIRROR_DIVERGENCE + "_count") == 3
    assert abs(_sum(text, metrics.GATEWAY_MIRROR_DIVERGENCE + "_sum") - 0.5) < 1e-9
    assert _sum(text, metrics.GATEWAY_MIRROR_TPOT + "_count") == 1
