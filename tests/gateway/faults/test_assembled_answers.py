"""Non-streamed requests are sent to replicas as streams and assembled (protocol/assemble.py):
hostile or frozen replicas on that path (issue 39, items 18, 19 and 23).

- a stream that ends with `[DONE]` and is then left open is answered at `[DONE]`;
- 30 MiB of events whose choices carry distinct indices cost the gateway process little
  memory (choices are bounded by the request's `n`, one event far below the answer's limit);
- a replica that goes silent mid-answer for many times its inter-token gaps is stalled: the
  request goes to another replica (nothing was sent to the client yet), long before the
  idle timeout.
"""

from __future__ import annotations

import json

import httpx
from kubellm.gateway.http import relay

from tests.fixtures.polling import wait_until
from tests.gateway.conftest import model
from tests.gateway.faults.peers import Later, Request, chunked, echo_id

HEAD = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"


def event(text: str, index: int = 0) -> bytes:
    choice = {"index": index, "text": text, "finish_reason": None}
    return b"data: " + json.dumps({"id": "c", "model": "m", "choices": [choice]}).encode() + b"\n\n"


def frame(piece: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(piece), piece)


def ask(url: str, prompt: str = "p", timeout: float = 60) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 300}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def test_a_stream_left_open_after_done_is_answered_at_done(raw_engine, gateway):
    """Issue 39.19: the whole answer, `[DONE]`, then the connection held open (no last
    chunk): the client gets its answer at `[DONE]`, not a 502 at the idle timeout (300 s
    here, past the client's own 30 s), and that connection is not reused."""

    def respond(request: Request) -> Later:
        head = (HEAD + echo_id(request) + "\r\n").encode()
        whole = head + frame(event("whole")) + frame(b"data: [DONE]\n\n")
        return Later(whole, 600, b"0\r\n\r\n")

    engine = raw_engine(respond)
    gw = gateway({"m": model("m", [engine.url])}, idle_timeout=300.0, total_timeout=600.0)
    for _ in range(2):  # the second on a new connection: the engine holds the first one
        answer = ask(gw.url, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "whole"


def test_distinct_choice_indices_keep_the_gateway_process_small(raw_engine, gateway_process):
    """Issue 39.18: a replica answering 30 MiB of events, each a new choice index, cost the
    gateway +1,000 MiB and a 4-5 s stall. Choices beyond the request's `n` are refused at
    once: the client gets a 502, the process stays small and keeps answering."""
    events = b"".join(event("a", i) for i in range(300_000))  # ~30 MiB
    pieces = [events[i : i + 65536] for i in range(0, len(events), 65536)]

    def respond(request: Request) -> bytes:
        return chunked([*pieces, b"data: [DONE]\n\n"], extra=echo_id(request))

    engine = raw_engine(respond)
    gw = gateway_process([{"name": "m", "endpoints": [engine.url]}], "--total-timeout", "60")
    before = gw.peak_mib
    answer = ask(gw.url)
    assert answer.status_code == 502, answer.text[:200]
    assert answer.json()["error"]["code"] == "upstream_error"
    assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200
    grown = gw.peak_mib - before
    assert grown < 60, f"the gateway's peak memory grew by {grown:.0f} MiB"


def test_a_replica_frozen_mid_answer_is_left_for_another_long_before_the_idle_timeout(
    raw_engine, engines, gateway
):
    """Issue 39.23: a replica that sends part of each non-streamed answer (as a stream) and
    then freezes: the gateway takes it for stalled after many times its inter-token gaps
    (`relay.STALL_FLOOR_S` at least), retries on another replica (nothing was sent to the
    client) and ejects it; the idle timeout (60 s by default) never comes into it."""

    def respond(request: Request) -> Later:
        head = (HEAD + echo_id(request) + "\r\n").encode()
        part = b"".join(frame(event(f"t{i} ")) for i in range(20))
        return Later(head + part, 600, b"0\r\n\r\n")

    frozen = raw_engine(respond)
    ((good, good_server),) = engines(1)
    gw = gateway({"m": model("m", [frozen.url, good_server], policy="round-robin")})
    answers = [ask(gw.url, f"p{i}", timeout=40) for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 4, [a.text[:200] for a in answers]
    assert all(a.json()["choices"][0]["text"].startswith(good.name) for a in answers)
    assert frozen.requests, "the frozen replica was never tried"
    labels = {"model": "m", "deployment": "m", "namespace": "default"}
    wait_until(lambda: gw.metric("kubellm_gateway_ready_endpoints", **labels) == 1, 10, "ejection")


def test_a_replica_whose_token_counters_stand_still_is_left_when_forwarded_whole(engines, gateway):
    """Issue 38: non-streamed requests forwarded whole (`--no-assemble-non-streamed`: no
    tokens on the way to watch).
    A replica that takes them and never answers, its scraped token counters standing still,
    is taken for stalled (`relay.ProgressWatch`, `relay.STALL_FLOOR_S` here) and the request
    goes to another replica, long before the idle timeout (60 s) or the total (600 s);
    a slow replica whose counters move is waited for."""
    (frozen, frozen_server), (slow, slow_server) = engines(2)
    frozen.behaviour.first_byte_delay = 600
    frozen.behaviour.token_counters = "still"
    slow.behaviour.first_byte_delay = relay.STALL_FLOOR_S * 1.5
    slow.behaviour.token_counters = "moving"
    gw = gateway(
        {"m": model("m", [frozen_server, slow_server], policy="round-robin")},
        assemble_non_streamed=False,
    )
    wait_until(lambda: frozen.scrapes > 1 and slow.scrapes > 1, 30, "both replicas scraped")
    answers = [ask(gw.url, f"p{i}", timeout=50) for i in range(2)]
    assert [a.status_code for a in answers] == [200] * 2, [a.text[:200] for a in answers]
    assert all(a.json()["choices"][0]["text"].startswith(slow.name) for a in answers)
    assert frozen.bodies, "the frozen replica was never tried"
    assert all("stream" not in body for body in frozen.bodies + slow.bodies)  # whole
    assert slow.completed == 2  # waited for, never abandoned as stalled


def test_by_default_only_a_replica_without_fresh_token_counters_gets_a_stream(engines, gateway):
    """Issue 38, the proxy's cost: by default a non-streamed request is assembled only
    where that buys something. A replica whose scraped token counters are fresh gets it
    whole (its stall watch is `relay.ProgressWatch`); one that exports none, or whose
    scrapes went stale, gets it as a stream (a stall found between its pieces)."""
    (counted, counted_server), (bare, bare_server) = engines(2)
    counted.behaviour.token_counters = "moving"
    gw = gateway(
        {"m": model("m", [counted_server, bare_server], policy="round-robin")},
        stale_after=1.0,
    )
    load = gw.gateway.load
    wait_until(
        lambda: counted.scrapes > 1 and load.stats(bare_server.url) is not None, 30, "scrapes"
    )
    answers = [ask(gw.url, f"p{i}") for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 4, [a.text[:200] for a in answers]
    assert counted.bodies and all("stream" not in body for body in counted.bodies)
    assert bare.bodies and all(body.get("stream") is True for body in bare.bodies)
    bare_server.stop()  # the counted replica alone, its scrapes then failing
    counted.behaviour.metrics_status = 500
    wait_until(lambda: load.stats(counted_server.url) is None, 30, "the counters gone stale")
    before = len(counted.bodies)
    answer = ask(gw.url, "stale")
    assert answer.status_code == 200, answer.text[:200]
    assert counted.bodies[before:] and counted.bodies[-1].get("stream") is True
