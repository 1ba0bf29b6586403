"""P/D through the endpoint picker: the picker runs the prefill leg against a loopback
engine that speaks vLLM's `kv_transfer_params` and hands Envoy the decode leg's body, or
the body as sent (local prefill) when the prefill engine fails."""

from __future__ import annotations

import json

import httpx
import pytest
from kubellm.gateway.discovery.base import Endpoint, FixedDiscovery, ModelTarget, PrefillSplit
from kubellm.gateway.epp.server import EndpointPicker, Exchange

from tests.fixtures.servers import ServerThread
from tests.gateway.epp.test_exchange import BODY, Mode, _body, _config, _destination, _headers
from tests.gateway.upstream import FakeEngine


@pytest.fixture
def pair():
    engines = [FakeEngine("pre"), FakeEngine("dec")]
    servers = [ServerThread(e.app()).start() for e in engines]
    yield engines, servers
    for server in servers:
        server.stop()


async def _exchange(servers) -> tuple[Exchange, list]:
    target = ModelTarget(
        "tiny", "tiny",
        endpoints=(Endpoint(servers[0].url, role="prefill"),
                   Endpoint(servers[1].url, role="decode")),
        prefill=PrefillSplit("Always"),
    )  # fmt: skip
    picker = EndpointPicker(FixedDiscovery({"tiny": target}))
    await picker.start()
    exchange = Exchange(picker)
    assert await exchange.handle(_headers(protocol_config=_config(Mode.FULL_DUPLEX_STREAMED))) == []
    return exchange, await exchange.handle(_body(BODY))


def _sent_body(answers) -> bytes:
    return b"".join(
        a.request_body.response.body_mutation.streamed_response.body for a in answers[1:]
    )


@pytest.mark.parametrize("prefill_status", [200, 500])
async def test_the_picker_runs_the_prefill_leg_and_sends_the_decode_leg(pair, prefill_status):
    (pre, _), servers = pair
    pre.behaviour.status = prefill_status
    exchange, answers = await _exchange(servers)
    try:
        header, _ = _destination(answers[0])
        assert header == servers[1].url.removeprefix("http://")  # the decode replica only
        (leg,) = pre.bodies
        assert leg["max_tokens"] == 1 and leg["kv_transfer_params"]["do_remote_decode"] is True
        sent = json.loads(_sent_body(answers))
        if prefill_status == 200:
            assert sent["kv_transfer_params"]["remote_engine_id"] == "pre"
            assert {k: v for k, v in sent.items() if k != "kv_transfer_params"} == json.loads(BODY)
        else:  # local prefill: the body as the client sent it
            assert sent == json.loads(BODY)
        outcome = "ok" if prefill_status == 200 else "failed"
        value = exchange.picker.metrics.registry.get_sample_value(
            "kubellm_gateway_disagg_legs_total",
            {"model": "tiny", "deployment": "tiny", "namespace": "default", "role": "prefill",
             "outcome": outcome},
        )  # fmt: skip
        assert value == 1
    finally:
        exchange.close()
        await exchange.picker.stop()


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
@pytest.mark.parametrize("prefill_status", [200, 500])
def test_a_split_through_the_real_envoy(pair, envoy_stack, mode, prefill_status):
    """Envoy + `kubellm epp` over static discovery with roles, `split: Always`: the prefill
    engine answers the leg and the decode engine receives its `kv_transfer_params` (the
    decode leg's body replaces the client's: a buffered body's mutation, or the full-duplex
    pieces); the client gets one answer, the decode engine's. A prefill engine answering
    500: the decode engine computes the prompt itself (the client's body), one answer."""
    (pre, dec), servers = pair
    pre.behaviour.status = prefill_status
    modes = {} if mode == "buffered" else {
        "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED"
    }  # fmt: skip
    stack = envoy_stack(
        [{"name": "tiny", "prefill": {"split": "Always"},
          "endpoints": [{"url": servers[0].url, "role": "prefill"},
                        {"url": servers[1].url, "role": "decode"}]}],
        **modes,
    )  # fmt: skip
    messages = [{"role": "user", "content": "hello"}]
    for stream in (False, True):
        answer = httpx.post(
            f"{stack.url}/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "stream": stream},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        if stream:
            deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                      for line in answer.text.splitlines()
                      if line.startswith("data: {")]  # fmt: skip
            text = "".join(deltas)
        else:
            text = answer.json()["choices"][0]["message"]["content"]
        assert text.startswith(dec.name)  # one answer, the decode replica's
        leg, decode = pre.bodies[-1], dec.bodies[-1]
        assert leg["max_tokens"] == 1 and leg["kv_transfer_params"]["do_remote_decode"] is True
        assert decode["messages"] == messages and decode["stream"] is stream
        if prefill_status == 200:
            params = decode["kv_transfer_params"]
            assert params["remote_engine_id"] == pre.name and params["do_remote_prefill"] is True
        else:  # local prefill on the decode engine
            assert "kv_transfer_params" not in decode
    assert len(pre.bodies) == 2 and len(dec.bodies) == 2  # one leg each, no retry
