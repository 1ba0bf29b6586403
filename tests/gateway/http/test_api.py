"""The client-facing API: pass-through, streaming, status codes, in OpenAI's envelope."""

from __future__ import annotations

import httpx
import openai
import pytest
from kubellm.gateway.http.app import hash_key

from tests.fixtures.polling import wait_until
from tests.gateway.conftest import model

CHAT = [{"role": "user", "content": "hello"}]


def test_chat_and_completions_pass_through(engines, gateway):
    ((engine, server),) = engines(1)
    gw = gateway({"tiny": model("tiny", [server])})
    client = gw.client()

    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, extra_body={"top_k": 3, "custom": {"a": 1}}
    )
    assert chat.choices[0].message.content.startswith(engine.name)
    assert engine.bodies[-1]["top_k"] == 3 and engine.bodies[-1]["custom"] == {"a": 1}

    completion = client.completions.create(model="tiny", prompt="once upon", max_tokens=4)
    assert completion.choices[0].text.startswith(engine.name)
    assert engine.bodies[-1]["prompt"] == "once upon"
    assert gw.metric(
        "kubellm_gateway_requests_total",
        model="tiny", deployment="tiny", namespace="default", target="replica", code="200",
    ) == 2  # fmt: skip


def test_streaming_passes_every_chunk(engines, gateway):
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 6
    gw = gateway({"tiny": model("tiny", [server])})
    stream = gw.client().chat.completions.create(model="tiny", messages=CHAT, stream=True)
    texts = [chunk.choices[0].delta.content for chunk in stream]
    assert texts == [f"{engine.name}-t{i} " for i in range(6)]
    labels = {"model": "tiny", "deployment": "tiny", "namespace": "default"}
    # a stream is measured when it closes, just after the client's last read
    wait_until(lambda: gw.metric("kubellm_gateway_slo_met_requests_total", **labels) == 1, 5)
    assert gw.metric("kubellm_gateway_time_to_first_token_seconds_count", **labels) == 1
    assert gw.metric("kubellm_gateway_inter_token_latency_seconds_count", **labels) >= 1


def test_models_lists_served_and_fallback_only_models(engines, gateway):
    from kubellm.gateway.discovery.base import FallbackTarget

    ((_, server),) = engines(1)
    fb = FallbackTarget(url="http://127.0.0.1:9/v1")
    gw = gateway({"tiny": model("tiny", [server]), "big": model("big", [], fallback=fb)})
    ids = [m.id for m in gw.client().models.list()]
    assert ids == ["big", "tiny"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "tiny", "messages": []}', "messages"),
        (b'{"model": "tiny", "messages": [{"role": "user"}], "max_tokens": -1}', "max_tokens"),
        (b'{"model": "tiny", "messages": [{"role": "user"}], "stream": "yes"}', "stream"),
    ],
)
def test_bad_requests_are_400_in_openai_envelope(engines, gateway, body, param):
    ((engine, server),) = engines(1)
    gw = gateway({"tiny": model("tiny", [server])})
    response = httpx.post(
        f"{gw.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert response.headers["x-should-retry"] == "false"
    assert engine.bodies == []


def test_unknown_model_is_404_model_not_found(engines, gateway):
    ((_, server),) = engines(1)
    gw = gateway({"tiny": model("tiny", [server])})
    with pytest.raises(openai.NotFoundError) as caught:
        gw.client().chat.completions.create(model="nope", messages=CHAT)
    assert caught.value.code == "model_not_found"
    refused = {"model": "", "deployment": "", "namespace": "", "target": "none", "code": "404"}
    assert gw.metric("kubellm_gateway_requests_total", **refused) == 1


def test_body_over_limit_is_413(engines, gateway):
    ((engine, server),) = engines(1)
    gw = gateway({"tiny": model("tiny", [server])}, max_body_bytes=1000)
    with pytest.raises(openai.APIStatusError) as caught:
        gw.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x" * 2000}]
        )
    assert caught.value.status_code == 413
    assert caught.value.code == "request_too_large"
    # a chunked body without a content-length is cut off at the limit too
    response = httpx.post(
        f"{gw.url}/v1/completions", content=iter([b'{"model": "tiny", "prompt": "', b"y" * 2000])
    )
    assert response.status_code == 413
    assert engine.bodies == []


def test_api_keys_are_checked_against_hashes(engines, gateway):
    ((_, server),) = engines(1)
    gw = gateway({"tiny": model("tiny", [server])}, api_key_hashes=frozenset({hash_key("s3cret")}))
    with pytest.raises(openai.AuthenticationError) as caught:
        gw.client(api_key="wrong").chat.completions.create(model="tiny", messages=CHAT)
    assert caught.value.code == "invalid_api_key"
    assert httpx.get(f"{gw.url}/v1/models").status_code == 401
    ok = gw.client(api_key="s3cret").chat.completions.create(model="tiny", messages=CHAT)
    assert ok.choices[0].message.content
    assert httpx.get(f"{gw.url}/health").status_code == 200  # probes need no key


def test_engine_4xx_passes_through_unchanged(engines, gateway):
    ((engine, server),) = engines(1)
    engine.behaviour.status = 422
    gw = gateway({"tiny": model("tiny", [server])})
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        gw.client().chat.completions.create(model="tiny", messages=CHAT)
    assert caught.value.body["message"] == "engine says no"
    assert len(engine.bodies) == 1  # not retried: the request itself is the problem


def test_metrics_endpoint_exposes_gateway_series(engines, gateway):
    ((_, server),) = engines(1)
    gw = gateway({"tiny": model("tiny", [server])})
    gw.client().chat.completions.create(model="tiny", messages=CHAT)
    text = httpx.get(f"{gw.url}/metrics").text
    assert 'kubellm_gateway_requests_total{code="200",deployment="tiny"' in text
    assert 'kubellm_gateway_pending_requests{deployment="tiny",model="tiny"' in text
    assert "kubellm_gateway_ready_endpoints" in text
