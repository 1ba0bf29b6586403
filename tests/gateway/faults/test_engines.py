"""Engines that misbehave: the gateway answers its clients correctly and stays healthy.

Each test starts a replica that breaks one rule of HTTP or of serving (an extra answer,
silence, giant or malformed headers, a giant body, forged chunk sizes, an early close),
sends real requests through a real gateway, and checks the client's bounded, correct
answer, that no answer reaches another client, and that the gateway still serves.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kubellm.api import SLO
from tests.fixtures.polling import wait_until
from tests.gateway.conftest import model
from tests.gateway.faults.peers import (
    Close,
    Later,
    Request,
    chunked,
    completion,
    echo_id,
    response,
)

LABELS = {"model": "m", "deployment": "m", "namespace": "default"}


def ask(url: str, prompt: str, stream: bool = False, timeout: float = 20) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def texts(answer: httpx.Response) -> list[str]:
    """The generated text of each SSE event (or of the JSON answer)."""
    if not answer.headers.get("content-type", "").startswith("text/event-stream"):
        return [c["text"] for c in answer.json()["choices"]]
    out = []
    for line in answer.text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            out += [c["text"] for c in event.get("choices", [])]
    return out


@pytest.mark.parametrize("delay", [0.0, 0.03])
def test_an_extra_answer_behind_a_valid_one_never_reaches_another_client(
    raw_engine, gateway, delay
):
    """The engine answers, then writes a second, unrequested answer on the same connection:
    at once (the gateway sees it behind the first), or 30 ms later (after the next request
    may already have gone out on that connection: only the echoed request id tells)."""

    def respond(request: Request) -> Later:
        prompt = request.json()["prompt"]
        stream = request.json().get("stream", False)
        mine = echo_id(request)
        return Later(completion(f"answer-to-{prompt}", stream, mine), delay,
                     completion(f"LEAKED-{prompt}", False, mine))  # fmt: skip

    engine = raw_engine(respond)
    gw = gateway({"m": model("m", [engine.url])}, eject_after_failures=1000)
    for i in range(12):
        for stream in (False, True):
            answer = ask(gw.url, f"req{i}{stream}", stream)
            assert answer.status_code in (200, 502), answer.text
            if answer.status_code == 200:  # its own answer, or none: never another's
                assert texts(answer) == [f"answer-to-req{i}{stream}"]
    sent = {r.headers.get("x-request-id") for r in engine.requests}
    assert len(sent) == len(engine.requests)  # every attempt had its own id


def sse_head(request: Request) -> bytes:
    """The status line and headers of a streamed answer (chunked), and nothing more."""
    return (
        chunked([])
        .partition(b"\r\n\r\n")[0]
        .replace(b"\r\n", f"\r\n{echo_id(request)}".encode(), 1)
        + b"\r\n\r\n"
    )


def first_event(text: str) -> bytes:
    event = b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"
    return b"%x\r\n" % len(event) + event + b"\r\n"


# Replicas that freeze under a request: `None` reads it and never answers; a `Later`
# answers in part, then holds the rest far past any timeout of these tests.
FREEZES = {
    "never answers": lambda r: None,
    "silent after its headers": lambda r: Later(sse_head(r), 60, b"0\r\n\r\n"),
}


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("freeze", list(FREEZES))
def test_a_frozen_replica_is_retried_elsewhere_and_ejected(
    raw_engine, engines, gateway, stream, freeze
):
    """A first byte is due within its timeout, streamed or not (a non-streamed request
    goes to the replica as a stream, its answer assembled by the gateway): past it,
    another replica takes the request, unseen by the client, and the frozen one is
    ejected. Issue 27: non-streamed requests hung until the total timeout."""
    frozen = raw_engine(FREEZES[freeze])
    ((good, good_server),) = engines(1)
    gw = gateway(
        {"m": model("m", [frozen.url, good_server], policy="round-robin")},
        first_byte_timeout=0.3,
        total_timeout=30.0,
    )
    answers = [ask(gw.url, f"p{i}", stream, timeout=10) for i in range(6)]
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert all(texts(a)[0].startswith(good.name) for a in answers)
    assert frozen.requests, "the frozen replica was never tried"
    wait_until(lambda: gw.metric("kubellm_gateway_ready_endpoints", **LABELS) == 1, 5, "ejection")


@pytest.mark.parametrize(
    "freeze",
    [
        *FREEZES,
        "silent after its first event",
    ],
)
def test_a_non_streamed_request_on_a_frozen_replica_fails_within_the_stream_timeouts(
    raw_engine, gateway, freeze
):
    """The only replica freezes (as a SIGSTOPped engine) under a non-streamed request: the
    client gets a 502 envelope at the first-byte or idle timeout, not at the total timeout
    (60 s here, past the client's own 10 s), and nothing of a half answer."""
    respond = FREEZES.get(freeze) or (
        lambda r: Later(sse_head(r) + first_event("half"), 60, b"0\r\n\r\n")
    )
    frozen = raw_engine(respond)
    gw = gateway(
        {"m": model("m", [frozen.url])},
        first_byte_timeout=0.3,
        idle_timeout=0.3,
        total_timeout=60.0,
    )
    answer = ask(gw.url, "p", timeout=10)
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == "upstream_error"
    assert b"half" not in answer.content
    assert frozen.requests[0].json()["stream"] is True
    labels = {**LABELS, "target": "replica", "code": "502"}
    wait_until(lambda: gw.metric("kubellm_gateway_requests_total", **labels) == 1, 5, "the 502")
    assert gw.gateway.load.in_flight == {}


def test_a_dead_replica_whose_last_figures_said_saturated_never_gets_a_502(engines, gateway):
    (alive, alive_server), (dead, dead_server) = engines(2)
    alive.behaviour.waiting = dead.behaviour.waiting = 20  # both saturated
    gw = gateway(
        {"m": model("m", [alive_server, dead_server], slo=SLO(ttft_seconds=0.2))},
        stale_after=0.3,
        scrape_interval=0.05,
    )
    wait_until(lambda: gw.gateway.load.stats(dead_server.url) is not None, 5, "a scrape")
    dead_server.stop()
    wait_until(lambda: gw.gateway.load.down(dead_server.url), 5, "the dead replica to be down")
    for i in range(4):  # its figures have gone stale: it must not look idle
        answer = ask(gw.url, f"p{i}")
        assert answer.status_code == 429, answer.text  # saturated, not "no replica answered"
    alive.behaviour.waiting = 0
    wait_until(lambda: gw.gateway.load.stats(alive_server.url).waiting == 0, 5, "a scrape")
    for i in range(4):
        answer = ask(gw.url, f"q{i}")
        assert answer.status_code == 200 and texts(answer)[0].startswith(alive.name)


def test_malformed_answers_are_502_envelopes_and_never_relayed(raw_engine, gateway):
    bodies = {
        "bare CR in a header": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\rx: 1\r\n"
        b"content-length: 2\r\n\r\n{}",
        "bare LF in a header": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\nx: 1\r\n"
        b"content-length: 2\r\n\r\n{}",
        "bad status line": b"HTTP/1.1 OK 200\r\ncontent-length: 2\r\n\r\n{}",
        "closed mid-body": Close(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"partial'),
        "bad chunk size": chunked([b"data: {}\n\n"], lambda p: b"-5"),
    }
    order = list(bodies)

    def respond(request: Request) -> bytes:
        return bodies[request.json()["prompt"]]

    engine = raw_engine(respond)
    gw = gateway({"m": model("m", [engine.url])}, eject_after_failures=100)
    for kind in order:
        answer = ask(gw.url, kind, stream=kind == "bad chunk size")
        assert answer.status_code == 502, kind
        assert answer.json()["error"]["code"] == "upstream_error", kind
        assert b"partial" not in answer.content
    engine.respond = lambda r: completion("fine")
    answer = ask(gw.url, "x")  # the gateway is healthy afterwards
    assert answer.status_code == 200 and texts(answer) == ["fine"]


@pytest.mark.parametrize("size_line", [b"-5", b"0x31", b"+0", b"zz", b"1;" + b"x" * 70_000])
def test_a_forged_chunk_size_mid_stream_ends_the_stream_with_an_error_event(
    raw_engine, gateway, size_line
):
    first = b'data: {"choices": [{"index": 0, "text": "ok"}]}\n\n'
    second = b'data: {"choices": [{"index": 0, "text": "forged"}]}\n\n'

    def respond(request: Request) -> bytes:
        head = chunked([first]).partition(b"\r\n\r\n")[0]
        good = head + b"\r\n\r\n" + b"%x\r\n" % len(first) + first + b"\r\n"
        return good + size_line + b"\r\n" + second + b"\r\n0\r\n\r\n"

    engine = raw_engine(respond)
    gw = gateway({"m": model("m", [engine.url])})
    answer = ask(gw.url, "p", stream=True)
    assert answer.status_code == 200
    assert answer.content.startswith(first)
    assert b"upstream_stream_error" in answer.content  # the error event ends the stream
    assert b"forged" not in answer.content and size_line[:8] not in answer.content
    assert not answer.content.rstrip().endswith(b"[DONE]")


def test_giant_or_endless_headers_and_bodies_keep_the_gateway_small(raw_engine, gateway_process):
    distinct = "".join(f"x-h{i}: {'v' * 1000}\r\n" for i in range(20_000))  # 20 MB, distinct
    repeated = f"x-same: {'v' * 1000}\r\n" * 20_000  # one name, 20 MB
    big_body = b"x" * (48 * 1024 * 1024)
    answers = {
        "distinct": response(b"{}", extra=distinct),
        "repeated": response(b"{}", extra=repeated),
        "body": response(big_body),
    }
    engine = raw_engine(lambda r: answers[r.json()["prompt"]])
    gw = gateway_process(
        [{"name": "m", "endpoints": [engine.url]}],
        "--max-response-bytes", str(1024 * 1024), "--total-timeout", "20",
    )  # fmt: skip
    before = gw.peak_mib
    for kind in answers:
        answer = ask(gw.url, kind)
        assert answer.status_code == 502, (kind, answer.text[:200])
        assert answer.json()["error"]["code"] == "upstream_error"
    assert httpx.get(f"{gw.url}/health", timeout=5).status_code == 200
    grown = gw.peak_mib - before
    assert grown < 40, f"the gateway's peak memory grew by {grown:.0f} MiB"
