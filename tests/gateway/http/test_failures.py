"""Failures: retry before the first byte, ejection, death mid-stream, client disconnect."""

from __future__ import annotations

import httpx
import openai
import pytest
from kubellm.gateway.discovery.base import FallbackTarget

from tests.fixtures.polling import wait_until
from tests.gateway.conftest import model

CHAT = [{"role": "user", "content": "hello"}]


def test_5xx_and_connection_errors_retry_on_another_replica(engines, gateway):
    (bad, bad_server), (good, good_server) = engines(2)
    bad.behaviour.status = 503
    gw = gateway({"tiny": model("tiny", [bad_server, good_server], policy="round-robin")})
    client = gw.client()
    for _ in range(2):
        answer = client.chat.completions.create(model="tiny", messages=CHAT)
        assert answer.choices[0].message.content.startswith(good.name)
    assert len(bad.bodies) >= 1  # it was tried, and the client never saw its 503

    bad_server.stop()  # connection refused from now on
    answer = client.chat.completions.create(model="tiny", messages=CHAT)
    assert answer.choices[0].message.content.startswith(good.name)


def test_every_replica_failing_is_a_502_envelope(engines, gateway):
    (a, sa), (b, sb) = engines(2)
    a.behaviour.status = b.behaviour.status = 500
    gw = gateway({"tiny": model("tiny", [sa, sb])})
    with pytest.raises(openai.InternalServerError) as caught:
        gw.client().chat.completions.create(model="tiny", messages=CHAT)
    assert caught.value.status_code == 502
    assert caught.value.code == "upstream_error"


def test_consecutive_failures_eject_an_endpoint(engines, gateway):
    (bad, bad_server), (good, good_server) = engines(2)
    bad.behaviour.status = 500
    gw = gateway(
        {"tiny": model("tiny", [bad_server, good_server], policy="round-robin")},
        eject_after_failures=2,
        eject_base_seconds=60,
    )
    client = gw.client()
    for _ in range(10):
        client.chat.completions.create(model="tiny", messages=CHAT)
    assert len(bad.bodies) == 2  # ejected after its second consecutive failure
    assert len(good.bodies) == 10
    labels = {"model": "tiny", "deployment": "tiny", "namespace": "default"}
    assert gw.metric("kubellm_gateway_ready_endpoints", **labels) == 1


def test_the_only_replicas_ejected_still_get_requests_without_a_fallback(engines, gateway):
    """Every replica of a model ejected and no fallback API: requests still go to them
    (Envoy's panic mode), rather than wait out the ejection in the queue and be refused.
    Issue 38: one fatal failure on a loaded gateway's only replica (a connect timeout)
    blacked the model out for the ejection's 5 s, then 10 s, ..."""
    ((engine, server),) = engines(1)
    engine.behaviour.status = 500
    gw = gateway(
        {"tiny": model("tiny", [server])},
        eject_after_failures=1,
        eject_base_seconds=300,
        zero_replica_wait_seconds=0.5,
    )
    client = gw.client(max_retries=0)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="tiny", messages=CHAT)
    labels = {"model": "tiny", "deployment": "tiny", "namespace": "default"}
    assert gw.metric("kubellm_gateway_ready_endpoints", **labels) == 0  # ejected
    engine.behaviour.status = 200  # back, and its ejection has 300 s to run
    answer = client.chat.completions.create(model="tiny", messages=CHAT)
    assert answer.choices[0].message.content.startswith(engine.name)
    assert len(engine.bodies) == 2


def test_ejected_replicas_leave_their_requests_to_the_fallback(engines, gateway):
    """With a fallback API, a model whose replicas are all ejected sends its requests
    there, as when none is ready (no panic routing to the ejected ones)."""
    (engine, server), (api, api_server) = engines(2)
    engine.behaviour.status = 500
    fallback = FallbackTarget(url=f"{api_server.url}/v1", model="ext")
    gw = gateway(
        {"tiny": model("tiny", [server], fallback=fallback)},
        eject_after_failures=1,
        eject_base_seconds=300,
    )
    client = gw.client(max_retries=0)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="tiny", messages=CHAT)
    engine.behaviour.status = 200
    answer = client.chat.completions.create(model="tiny", messages=CHAT)
    assert answer.choices[0].message.content.startswith(api.name)
    assert len(engine.bodies) == 1


def test_replica_dying_mid_stream_ends_with_error_event(engines, gateway):
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 10
    engine.behaviour.die_after_tokens = 3
    gw = gateway({"tiny": model("tiny", [server])})
    stream = gw.client(timeout=10).chat.completions.create(model="tiny", messages=CHAT, stream=True)
    received = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    assert received == [f"{engine.name}-t{i} " for i in range(3)]
    assert "mid-stream" in caught.value.message
    labels = {"model": "tiny", "deployment": "tiny", "namespace": "default"}
    wait_until(
        lambda: gw.metric(
            "kubellm_gateway_requests_total", **labels, target="replica", code="502"
        ) == 1,
        5,
    )  # fmt: skip
    assert gw.metric("kubellm_gateway_pending_requests", **labels) == 0


def test_client_disconnect_cancels_the_upstream_stream(engines, gateway):
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 1000
    engine.behaviour.token_delay = 0.05
    gw = gateway({"tiny": model("tiny", [server])})
    body = {"model": "tiny", "messages": CHAT, "stream": True}
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert gw.metric("kubellm_gateway_endpoint_in_flight", url=server.url) == 1
    # leaving the block closed the client's connection mid-stream
    wait_until(lambda: engine.cancelled == 1, 10, "the engine to see the cancellation")
    assert engine.completed == 0
    labels = {"model": "tiny", "deployment": "tiny", "namespace": "default"}
    wait_until(lambda: gw.metric("kubellm_gateway_pending_requests", **labels) == 0, 5)
    assert gw.metric("kubellm_gateway_endpoint_in_flight", url=server.url) == 0


def test_client_leaving_a_non_streamed_request_frees_the_replica(engines, gateway):
    ((engine, server),) = engines(1)
    engine.behaviour.first_byte_delay = 5
    gw = gateway({"tiny": model("tiny", [server])})
    with pytest.raises(openai.APITimeoutError):
        gw.client(timeout=0.5).chat.completions.create(model="tiny", messages=CHAT)
    labels = {"model": "tiny", "deployment": "tiny", "namespace": "default"}
    wait_until(lambda: gw.gateway.scheduler.in_flight() == {}, 3, "the upstream request to close")
    assert gw.metric("kubellm_gateway_pending_requests", **labels) == 0
    assert gw.metric("kubellm_gateway_requests_total", **labels, target="none", code="499") == 1


async def test_disconnect_watch_leaves_nothing_for_the_cyclic_collector():
    """A finished request's watch, watcher task and cancelled error are freed by reference
    counting alone: none of them waits for a (pausing) cyclic garbage collection."""
    import asyncio
    import gc
    import weakref

    from kubellm.gateway.http.relay import DisconnectWatch

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    gc.disable()
    try:
        before = asyncio.all_tasks()
        async with DisconnectWatch(receive) as watch:
            (task,) = asyncio.all_tasks() - before  # the watcher
            watcher = weakref.ref(task)
            del task
        loop, deadline = asyncio.get_running_loop(), asyncio.get_running_loop().time() + 5
        while (running := watcher()) is not None and not running.done():
            assert loop.time() < deadline, "the cancelled watcher did not finish"
            await asyncio.sleep(0)  # let it run to its end
        del running
        assert not watch.disconnected
        del watch
        assert watcher() is None
    finally:
        gc.enable()
