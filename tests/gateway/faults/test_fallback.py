"""A misbehaving fallback API: its errors and redirects never reach the client, and its
key never leaves the gateway (not in answers, not in logs or error messages)."""

from __future__ import annotations

import logging
import subprocess
import sys

import httpx
from kubellm.gateway.discovery.base import FallbackTarget
from kubellm.gateway.discovery.static import StaticDiscovery

from tests.gateway.conftest import model
from tests.gateway.faults.peers import Request, completion, response

KEY = "sk-secret-fallback-key-123"


def ask(url: str) -> httpx.Response:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=20)


def test_a_fallback_echoing_the_key_in_its_error_never_shows_it(raw_engine, gateway):
    def echo_credentials(request: Request) -> bytes:
        given = request.headers["authorization"]
        body = b'{"error": "bad key: %s"}' % given.encode()
        return response(body, "401 Unauthorized", extra=f"x-echo: {given}\r\n")

    fallback = raw_engine(echo_credentials)
    target = FallbackTarget(url=f"{fallback.url}/v1", api_key=KEY)
    gw = gateway({"m": model("m", [], fallback=target)})  # no replica: all goes to it
    answer = ask(gw.url)
    assert fallback.requests and fallback.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert answer.status_code == 502
    assert answer.json()["error"]["code"] == "fallback_auth_failed"
    assert KEY not in answer.text and all(KEY not in v for v in answer.headers.values())


def test_a_fallback_redirect_is_not_followed(raw_engine, gateway):
    elsewhere = raw_engine(lambda r: completion("the prompt went elsewhere"))
    location = f"Location: {elsewhere.url}/v1/completions\r\n"
    fallback = raw_engine(lambda r: response(b"", "307 Temporary Redirect", extra=location))
    target = FallbackTarget(url=f"{fallback.url}/v1", api_key=KEY)
    gw = gateway({"m": model("m", [], fallback=target)})
    answer = ask(gw.url)
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "fallback_redirect"
    assert len(fallback.requests) == 1 and elsewhere.requests == []


def test_a_static_file_error_names_the_line_but_never_prints_an_inline_key(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "models:\n- name: m\n  endpoints: [http://127.0.0.1:1]\n"
        f"  fallback: {{url: http://127.0.0.1:2, apiKey: {KEY}\n"  # the brace never closes
    )
    run = subprocess.run(
        [sys.executable, "-m", "kubellm.gateway.cli", "--static", str(config), "--port", "1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 1
    assert "line " in run.stderr and str(config) in run.stderr
    assert KEY not in run.stderr + run.stdout


def test_a_static_file_broken_on_reload_is_logged_counted_and_the_last_good_kept(tmp_path, caplog):
    config = tmp_path / "gateway.yaml"
    config.write_text("models:\n- name: m\n  endpoints: [http://127.0.0.1:1]\n")
    errors: list[int] = []
    discovery = StaticDiscovery(config, on_reload_error=lambda: errors.append(1))
    before = discovery.snapshot()
    config.write_text(f"models:\n- name: m\n  fallback: {{url: http://x, apiKey: {KEY}\n")
    with caplog.at_level(logging.ERROR, logger="kubellm.gateway"):
        assert discovery.reload() is False
    assert discovery.snapshot() is before  # the last good configuration still serves
    assert errors == [1]
    (record,) = caplog.records
    assert "line " in record.getMessage() and KEY not in record.getMessage()
