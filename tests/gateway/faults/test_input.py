"""Bodies the gateway cannot process are 400s in OpenAI's envelope; anything unexpected
inside the gateway is one 500 envelope with a request id, logged once."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from tests.gateway.conftest import model

HEADERS = {"content-type": "application/json"}


def post(url: str, raw: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions", content=raw, headers=headers or HEADERS, timeout=20
    )


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "a\\udfffb"}]}', "surrogate"),
        (b"[" * 1000 + b"]" * 1000, "nested deeper"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "x": '
            + b"[" * 100
            + b"]" * 100
            + b"}",
            "nested deeper",
        ),
        (b'{"model": "m", "messages": "\xff\xfe"}', "UTF-8"),
        # KV-transfer parameters name a host and port the engine pulls KV blocks from: only
        # the gateway's own prefill leg may set them, never a client.
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
            b'"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "10.0.0.9", '
            b'"remote_port": 5600, "remote_block_ids": [1]}}',
            "kv_transfer_params",
        ),
    ],
)
def test_bodies_the_gateway_cannot_process_are_400_envelopes(engines, gateway, raw, says):
    ((engine, server),) = engines(1)
    gw = gateway({"m": model("m", [server])})
    answer = post(gw.url, raw)
    assert answer.status_code == 400
    assert says in answer.json()["error"]["message"]
    assert engine.bodies == []
    # a valid pair of surrogates is one character, and passes
    pair = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    ok = post(gw.url, pair)
    assert ok.status_code == 200


def test_an_unexpected_failure_is_a_500_envelope_with_a_request_id(engines, gateway, caplog):
    ((_, server),) = engines(1)
    gw = gateway({"m": model("m", [server])})

    async def broken(*args: object) -> None:
        raise RuntimeError("a bug")

    gw.gateway.scheduler.admit = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="kubellm.gateway"):
        answer = post(gw.url, b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}',
                      {**HEADERS, "x-request-id": "req-42"})  # fmt: skip
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["code"] == "internal_error" and "req-42" in error["message"]
    records = [r for r in caplog.records if "req-42" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None


def test_deep_nesting_is_refused_whatever_the_recursion_limit():
    """json.loads gives up on its own only below the recursion limit, which libraries
    (torch among them) raise: the gateway's own depth cap decides."""
    import sys

    from kubellm.gateway.protocol.errors import GatewayError
    from kubellm.gateway.protocol.openai import CHAT, parse_body

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        for raw in (
            b"[" * 1000 + b"]" * 1000,
            b'{"model": "m", "x": ' + b"[" * 100 + b"]" * 100 + b"}",
        ):
            with pytest.raises(GatewayError, match="nested deeper"):
                parse_body(raw, CHAT)
    finally:
        sys.setrecursionlimit(old)


def test_a_body_parses_as_json_loads_parses_it_whatever_its_encoding():
    """`parse_body` decodes a body opening with `{` as UTF-8 without `json.loads`'s
    encoding detection: the same bodies pass, in the same encodings, and the same fail."""
    from kubellm.gateway.protocol.errors import GatewayError
    from kubellm.gateway.protocol.openai import CHAT, parse_body

    text = '{"model": "m", "messages": [{"role": "user", "content": "é \\ud83d\\ude00"}]}'
    for encoding in ("utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"):
        assert parse_body(text.encode(encoding), CHAT) == json.loads(text), encoding
    for raw in (b'{"model": "m", "messages": "\xe9"}', b"{\x00", b'{"model": "m"} x'):
        with pytest.raises(GatewayError):
            parse_body(raw, CHAT)
