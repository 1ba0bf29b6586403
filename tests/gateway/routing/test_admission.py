"""Overflow: fallback on saturation and on zero replicas, the bounded queue, 429/503."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from kubellm.gateway.discovery.base import FallbackTarget

from kubellm.api import SLO
from tests.fixtures.polling import wait_until
from tests.gateway.conftest import model

CHAT = [{"role": "user", "content": "hello"}]
LABELS = {"model": "tiny", "deployment": "tiny", "namespace": "default"}


def _fallback(server, **kw) -> FallbackTarget:
    return FallbackTarget(url=f"{server.url}/v1", model="external-model", api_key="sk-fb", **kw)


def test_saturated_replicas_overflow_to_fallback(engines, gateway):
    (engine, server), (api, api_server) = engines(2)
    engine.behaviour.waiting = 50  # the engine's own metrics say its queue is deep
    gw = gateway({"tiny": model("tiny", [server], fallback=_fallback(api_server))})
    wait_until(lambda: gw.gateway.load.stats(server.url) is not None, 5, "a scrape")

    answer = gw.client().chat.completions.create(model="tiny", messages=CHAT)
    assert answer.choices[0].message.content.startswith(api.name)
    assert answer.model == "tiny"  # the fallback's model name is mapped back
    assert api.bodies[-1]["model"] == "external-model"
    assert api.headers[-1]["authorization"] == "Bearer sk-fb"
    assert engine.bodies == []
    stream = gw.client().chat.completions.create(model="tiny", messages=CHAT, stream=True)
    assert {chunk.model for chunk in stream} == {"tiny"}
    assert gw.metric("kubellm_gateway_fallback_requests_total", **LABELS, reason="saturated") == 2
    wait_until(  # a stream is counted when it closes, just after the client's last read
        lambda: gw.metric(
            "kubellm_gateway_requests_total", **LABELS, target="fallback", code="200"
        ) == 2,
        5,
    )  # fmt: skip

    engine.behaviour.waiting = 0  # the queue drains: back to the replica
    wait_until(lambda: gw.gateway.load.stats(server.url).waiting == 0, 5, "a fresh scrape")
    answer = gw.client().chat.completions.create(model="tiny", messages=CHAT)
    assert answer.choices[0].message.content.startswith(engine.name)


def test_zero_replicas_go_to_fallback(engines, gateway):
    ((api, api_server),) = engines(1)
    gw = gateway({"tiny": model("tiny", [], fallback=_fallback(api_server))})
    answer = gw.client().completions.create(model="tiny", prompt="hi")
    assert answer.choices[0].text.startswith(api.name)
    assert gw.metric(
        "kubellm_gateway_fallback_requests_total", **LABELS, reason="no-ready-replicas"
    ) == 1  # fmt: skip
    # The fallback's own usage is counted, for the dashboard's cost panel.
    prompt = gw.metric("kubellm_gateway_fallback_tokens_total", **LABELS, kind="prompt")
    completion = gw.metric("kubellm_gateway_fallback_tokens_total", **LABELS, kind="completion")
    assert (prompt, completion) == (answer.usage.prompt_tokens, answer.usage.completion_tokens)
    assert completion > 0


def test_zero_replicas_without_fallback_wait_then_503(gateway):
    gw = gateway({"tiny": model("tiny", [])}, zero_replica_wait_seconds=0.2)
    with pytest.raises(openai.InternalServerError) as caught:
        gw.client().chat.completions.create(model="tiny", messages=CHAT)
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "1"
    assert gw.metric("kubellm_gateway_requests_total", **LABELS, target="none", code="503") == 1


def test_request_waits_while_scaling_from_zero_and_is_served(engines, gateway):
    ((engine, server),) = engines(1)
    gw = gateway({"tiny": model("tiny", [])}, zero_replica_wait_seconds=20)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(gw.client().chat.completions.create, model="tiny", messages=CHAT)
        # the autoscaler sees this gauge and scales the deployment up from zero
        wait_until(lambda: gw.metric("kubellm_gateway_pending_requests", **LABELS) == 1, 5)
        gw.update({"tiny": model("tiny", [server])})
        answer = future.result(timeout=10)
    assert answer.choices[0].message.content.startswith(engine.name)
    assert gw.metric("kubellm_gateway_pending_requests", **LABELS) == 0


def _hold(gw, count: int):
    """Start `count` streaming requests in threads; returns the pool and futures."""
    pool = concurrent.futures.ThreadPoolExecutor(count)

    def one() -> list[str]:
        stream = gw.client().chat.completions.create(model="tiny", messages=CHAT, stream=True)
        return [c.choices[0].delta.content for c in stream]

    return pool, [pool.submit(one) for _ in range(count)]


def test_saturated_without_fallback_queues_within_ttft_then_429(engines, gateway):
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 40
    engine.behaviour.token_delay = 0.05
    gw = gateway(
        {"tiny": model("tiny", [server], slo=SLO(ttft_seconds=0.2))},
        thresholds=_thresholds(max_in_flight=1),
    )
    pool, futures = _hold(gw, 1)
    wait_until(lambda: engine.active == 1, 5)
    with pytest.raises(openai.RateLimitError) as caught:
        gw.client().chat.completions.create(model="tiny", messages=CHAT)
    assert caught.value.response.headers["retry-after"] == "1"
    assert caught.value.code == "rate_limit_exceeded"
    assert futures[0].result(timeout=10)  # the held request was not disturbed
    pool.shutdown()
    assert gw.metric("kubellm_gateway_requests_total", **LABELS, target="none", code="429") == 1
    assert len(engine.bodies) == 1


def test_queued_request_is_served_when_capacity_frees(engines, gateway):
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 5
    engine.behaviour.token_delay = 0.05
    gw = gateway(
        {"tiny": model("tiny", [server], slo=SLO(ttft_seconds=20))},
        thresholds=_thresholds(max_in_flight=1),
    )
    pool, futures = _hold(gw, 3)
    results = [f.result(timeout=20) for f in futures]
    pool.shutdown()
    assert all(len(r) == 5 for r in results)
    assert gw.metric("kubellm_gateway_queue_wait_seconds_count", **LABELS) == 3
    assert gw.metric("kubellm_gateway_queue_wait_seconds_sum", **LABELS) > 0


def test_fallback_concurrency_cap_then_queue(engines, gateway):
    ((api, api_server),) = engines(1)
    api.behaviour.tokens = 20
    api.behaviour.token_delay = 0.05
    fb = _fallback(api_server, max_concurrency=1)
    gw = gateway({"tiny": model("tiny", [], fallback=fb)}, zero_replica_wait_seconds=0.2)
    pool, futures = _hold(gw, 1)
    wait_until(lambda: api.active == 1, 5)
    with pytest.raises(openai.InternalServerError) as caught:  # cap reached, no replica: 503
        gw.client().chat.completions.create(model="tiny", messages=CHAT)
    assert caught.value.status_code == 503
    futures[0].result(timeout=10)
    pool.shutdown()
    assert len(api.bodies) == 1


def _thresholds(**kw):
    from kubellm.gateway.routing.admission import Thresholds

    return Thresholds(**kw)


def test_short_predicted_wait_queues_for_a_replica_long_one_goes_to_fallback(engines, gateway):
    """Saturated replicas that finish requests often: a request waits for a slot rather
    than paying for the external API; when the predicted wait breaks the TTFT target,
    it goes to the fallback at once instead of spending its budget in the queue."""
    (engine, server), (api, api_server) = engines(2)
    engine.behaviour.tokens = 2
    gw = gateway(
        {"tiny": model("tiny", [server], slo=SLO(ttft_seconds=5), fallback=_fallback(api_server))},
        thresholds=_thresholds(max_in_flight=1),
    )
    for _ in range(10):  # ten answers finished within the window: about 1 per second
        gw.client().chat.completions.create(model="tiny", messages=CHAT)
    assert gw.gateway.scheduler.completions.rate([server.url]) >= 0.9

    engine.behaviour.tokens, engine.behaviour.token_delay = 10, 0.05  # holds its slot ~0.5 s
    pool, futures = _hold(gw, 1)
    wait_until(lambda: engine.active == 1, 5)
    answer = gw.client().chat.completions.create(model="tiny", messages=CHAT)  # waits ~1 s
    assert answer.choices[0].message.content.startswith(engine.name)
    futures[0].result(timeout=10)
    assert api.bodies == []
    assert gw.metric("kubellm_gateway_queue_wait_seconds_sum", **LABELS) > 0

    # a TTFT target shorter than the predicted wait (~0.8 s): the fallback, without first
    # queueing until the 0.6 s budget is spent as it would with no prediction
    pool.shutdown()
    fallback = _fallback(api_server)
    gw.update({"tiny": model("tiny", [server], slo=SLO(ttft_seconds=0.6), fallback=fallback)})
    waited = gw.metric("kubellm_gateway_queue_wait_seconds_sum", **LABELS)
    pool, futures = _hold(gw, 1)
    wait_until(lambda: engine.active == 1, 5)
    answer = gw.client().chat.completions.create(model="tiny", messages=CHAT)
    assert answer.choices[0].message.content.startswith(api.name)
    assert gw.metric("kubellm_gateway_queue_wait_seconds_sum", **LABELS) - waited < 0.3
    futures[0].result(timeout=10)
    pool.shutdown()
    assert gw.metric("kubellm_gateway_fallback_requests_total", **LABELS, reason="saturated") == 1


def test_by_default_a_replica_is_saturated_at_the_autoscalers_queue_target():
    """The gateway overflows where the autoscaler's queue signal would start asking for a
    replica (docs/autoscaling.md): both front ends' flags and the library default agree."""
    import argparse

    from kubellm.gateway.routing import flags
    from kubellm.gateway.routing.admission import Thresholds, saturated
    from kubellm.gateway.routing.scorers.base import Candidate

    from kubellm.api import Autoscaling

    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    from_flags = flags.settings_from(parser.parse_args([])).thresholds
    assert from_flags == Thresholds()
    depth = Autoscaling().target_queue_depth
    for thresholds in (from_flags, Thresholds()):
        assert saturated(Candidate(url="a", waiting=depth, kv_usage=0.1), thresholds)
        assert not saturated(Candidate(url="a", waiting=depth - 1, kv_usage=0.1), thresholds)


def test_capacity_freed_during_a_pass_is_seen_without_waiting_for_the_next_wake(monkeypatch):
    """A release while a queued request's pass runs (its gates may free capacity) wakes it
    again at once: the wake is not lost because no event was made to wait on yet."""
    import asyncio

    from kubellm.gateway.discovery.base import FixedDiscovery
    from kubellm.gateway.routing import scheduler as scheduler_module
    from kubellm.gateway.routing.dispatch import Gate
    from kubellm.gateway.routing.router import routing_request
    from kubellm.gateway.routing.settings import SchedulerSettings, Thresholds

    from kubellm.api import SLO

    # a lost wake would wait for the TTFT target (here 120 s), the next timed look
    monkeypatch.setattr(scheduler_module, "WAKE_IN", 3600.0)
    url = "http://127.0.0.1:9"
    target = model("tiny", [url], slo=SLO(ttft_seconds=120))
    settings = SchedulerSettings(thresholds=Thresholds(max_in_flight=1))
    passes = []

    class FreesOnFirstPass(Gate):
        def narrow(self, p):
            passes.append(len(p.open))
            p.wake_in = 3600.0  # no timed look before the TTFT target
            if len(passes) == 1:
                held()  # the only replica's slot frees mid-pass (a release wakes the queue)

    async def run():
        scheduler = scheduler_module.Scheduler(FixedDiscovery({"tiny": target}), settings)
        scheduler.gates = (*scheduler.gates, FreesOnFirstPass())
        nonlocal held
        held = scheduler.load.acquire(url)  # saturated: the first pass queues
        routing = routing_request("tiny", {"prompt": "hi"}, None)
        return await asyncio.wait_for(scheduler.admit(target, routing), 30)

    held = None
    ticket = asyncio.run(run())
    assert ticket.route == "replica"
    assert passes == [0, 1]  # queued on the first pass, admitted on the second
