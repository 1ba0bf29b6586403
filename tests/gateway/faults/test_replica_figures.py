"""Replicas that lie to the latency model, through a real gateway process on loopback.

- Figures: a replica whose `/metrics` says NaN, a negative count, +Inf or 1e300 (all
  valid Prometheus text) is a replica whose load is unknown; admission never raises on
  what one replica reports, under any policy, and every request is answered.
- Streams: a replica that sends one token at once and then drops the connection is not
  learnt as the fastest (a TTFT is kept only from an answer that ended whole), and the
  break is a failure the outlier logic sees: it is ejected, and the honest replica
  serves nearly every request whole.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fixtures.polling import wait_until
from tests.gateway.faults.peers import Close, Later, Request, completion


def figures(waiting: str = "0", running: str = "0", kv: str = "0") -> bytes:
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
    ).encode()


HOSTILE_FIGURES = {
    "nan": figures(running="NaN", waiting="NaN", kv="NaN"),
    "negative": figures(running="-3", waiting="-5", kv="-1"),
    "infinite": figures(running="+Inf", waiting="+Inf", kv="+Inf"),
    "huge": figures(running="1e300", waiting="1e300", kv="1e300"),
    "minus-infinite": figures(running="-Inf", waiting="-Inf", kv="1.5"),
}


def answer(request: Request) -> Later:
    """A valid answer, 50 ms in (so that requests overlap on each replica)."""
    return Later(b"", 0.05, completion("ok", stream=bool(request.json().get("stream"))))


def ask(url: str, prompt: str, stream: bool) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize("policy", ["prefix-aware", "slo-aware", "least-load"])
def test_figures_no_engine_reports_sensibly_never_fail_a_request(
    raw_engine, gateway_process, policy
):
    honest = raw_engine(answer)
    hostile = [raw_engine(answer, metrics_body=body) for body in HOSTILE_FIGURES.values()]
    replicas = [honest, *hostile]
    gw = gateway_process(
        [{"name": "m", "endpoints": [e.url for e in replicas], "routing": {"policy": policy}}]
    )
    wait_until(lambda: all(e.scrapes >= 2 for e in replicas), 60, "the gateway to scrape")

    def one(i: int) -> tuple[int, int, str]:
        got = ask(gw.url, f"question {i} " + "x" * (50 * i), stream=i % 2 == 0)
        return i, got.status_code, got.text

    with ThreadPoolExecutor(8) as pool:  # concurrent: prompts ahead on each replica
        answers = list(pool.map(one, range(60)))
    failed = [(i, code, text[:200]) for i, code, text in answers if code != 200 or "ok" not in text]
    assert not failed, f"{len(failed)} of 60 failed: {failed[:3]}"
    assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200


FIRST_EVENT = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def one_token_then_gone(request: Request) -> bytes:
    """A first event at once, then the connection dropped mid-body (no last chunk)."""
    event = b'data: {"choices": [{"index": 0, "text": "fast"}]}\n\n'
    return Close(FIRST_EVENT + b"%x\r\n" % len(event) + event + b"\r\n")


def honest_and_slower(request: Request) -> Later:
    """A whole stream whose first token comes 50 ms in."""
    return Later(b"", 0.05, completion("ok", stream=True))


@pytest.mark.parametrize("policy", ["slo-aware", "prefix-aware"])
def test_streams_a_replica_that_breaks_every_stream_after_one_token_is_routed_around(
    raw_engine, gateway_process, policy
):
    breaker = raw_engine(one_token_then_gone)
    honest = raw_engine(honest_and_slower)
    gw = gateway_process(
        [{"name": "m", "endpoints": [breaker.url, honest.url], "routing": {"policy": policy}}]
    )
    wait_until(lambda: breaker.scrapes >= 1 and honest.scrapes >= 1, 60, "the first scrapes")
    whole = broken = 0
    for i in range(40):
        got = ask(gw.url, f"question {i}", stream=True)
        assert got.status_code == 200, got.text[:200]
        if "[DONE]" in got.text and "upstream_stream_error" not in got.text:
            whole += 1
        else:
            broken += 1
    # today's main: the breaker is learnt as the fastest and gets 38-39 of 40, all broken
    assert len(breaker.requests) <= 10, (len(breaker.requests), whole, broken)
    assert whole >= 30, (whole, broken)
