"""End to end: client -> a real Envoy (reference-style configuration) -> kubellm epp over
ext_proc -> the picked replica (simulated engines), on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import sys
import threading
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubellm.engine import sim_profiles
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.engines import free_port, wait_until
from tests.gateway.epp.conftest import START_TIMEOUT_S, Process, responds

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
SHARED = "You are a careful assistant. Answer in one line. " * 12


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)


def _successes(replica: str) -> float:
    text = httpx.get(f"{replica}/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:request_success_total"
    )


def test_completion_goes_through_envoy_to_a_picked_replica(envoy_stack, sims):
    replicas = sims(2)
    stack = envoy_stack([{"name": "tiny", "endpoints": replicas}])
    response = httpx.post(f"{stack.url}/v1/completions", json=BODY, timeout=20)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    assert sum(_successes(r) for r in replicas) == 1
    wait_until(lambda: stack.metric("kubellm_gateway_requests_total", target="replica",
               code="200") == 1, 5, "the EPP to count the answer")  # fmt: skip
    assert stack.metric("kubellm_gateway_pending_requests") == 0


def test_shared_prefix_requests_stay_on_one_replica(envoy_stack, sims):
    replicas = sims(2)
    stack = envoy_stack([{"name": "tiny", "endpoints": replicas}])
    client = _client(stack.url)
    for i in range(6):
        client.completions.create(model="tiny", prompt=f"{SHARED} question {i}", max_tokens=2)
    counts = sorted(_successes(r) for r in replicas)
    assert sum(counts) == 6
    assert counts[-1] >= 5, counts  # the first, cold, prompt may go by load
    assert stack.metric("kubellm_gateway_prefix_match_ratio_count") == 6


@pytest.mark.parametrize(
    "modes",
    [("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED"), ("BUFFERED", "STREAMED")],
    ids=["reference", "bootstrap"],
)
def test_streaming_chat_through_envoy_observes_ttft_and_itl(envoy_stack, sims, modes):
    # ~20 ms per token: chunks arrive apart, so the EPP sees gaps between them
    replicas = sims(2, time_scale=10.0)
    stack = envoy_stack(
        [{"name": "tiny", "endpoints": replicas}],
        request_body_mode=modes[0], response_body_mode=modes[1],
    )  # fmt: skip
    stream = _client(stack.url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=8, stream=True
    )
    texts = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta]
    assert len([t for t in texts if t]) >= 2
    wait_until(lambda: stack.metric("kubellm_gateway_time_to_first_token_seconds_count") == 1,
               5, "TTFT observed")  # fmt: skip
    assert stack.metric("kubellm_gateway_inter_token_latency_seconds_count") >= 1
    assert stack.metric("kubellm_gateway_requests_total", target="replica", code="200") == 1
    assert stack.metric("kubellm_gateway_pending_requests") == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"model": "tiny", "prompt": ', 400, None),  # not JSON
        (json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
        (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "model"),
    ],
)
def test_malformed_requests_get_openai_errors_from_envoy(envoy_stack, sims, body, status, param):
    stack = envoy_stack([{"name": "tiny", "endpoints": sims(1)}])
    response = httpx.post(f"{stack.url}/v1/completions", content=body, timeout=10,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_no_replica_is_503_and_saturation_is_429(envoy_stack, scripted):
    stack = envoy_stack(
        [
            {"name": "empty", "endpoints": []},
            {"name": "tiny", "endpoints": [scripted.url], "slo": {"ttftSeconds": 0.05}},
        ],
        epp_args=("--zero-replica-wait", "0", "--max-in-flight", "1"),
    )
    empty = httpx.post(f"{stack.url}/v1/completions", json={**BODY, "model": "empty"}, timeout=10)
    assert empty.status_code == 503
    assert empty.json()["error"]["code"] == "service_unavailable"
    stream = {**BODY, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=stream, timeout=20) as held:
        assert held.status_code == 200
        chunks = held.iter_bytes()  # kept: a dropped iterator closes the response
        next(chunks)  # in flight on the only replica until it is dropped
        shed = httpx.post(f"{stack.url}/v1/completions", json=BODY, timeout=10)
        assert shed.status_code == 429
        assert shed.json()["error"]["type"] == "rate_limit_error"
        assert shed.headers["retry-after"]
        scripted.drop.set()


@pytest.mark.parametrize("fail_open", [True, False])
def test_failure_mode_when_the_epp_is_down(envoy_stack, sims, fail_open):
    replicas = sims(1)
    # FailOpen buffers request bodies (gateway/epp/envoy.py says why)
    stack = envoy_stack([{"name": "tiny", "endpoints": replicas}], failure_mode_allow=fail_open)
    assert httpx.post(f"{stack.url}/v1/completions", json=BODY, timeout=10).status_code == 200
    stack.stop_epp()
    response = httpx.post(f"{stack.url}/v1/completions", json=BODY, timeout=10)
    if fail_open:  # Envoy sends it to the pool itself
        assert response.status_code == 200, response.text
        assert _successes(replicas[0]) == 2
    else:
        assert response.status_code >= 500
        assert _successes(replicas[0]) == 1


def test_client_cannot_pick_its_own_upstream(envoy_stack, sims):
    """A destination header sent by the client is removed before the EPP answers."""
    replicas = sims(1)
    stack = envoy_stack([{"name": "tiny", "endpoints": replicas}], failure_mode_allow=True)
    stack.stop_epp()
    forged = {"x-gateway-destination-endpoint": "127.0.0.1:1"}
    response = httpx.post(f"{stack.url}/v1/completions", json=BODY, headers=forged, timeout=10)
    assert response.status_code == 200  # FailOpen's pool route, not the forged address


def test_an_adapter_no_replica_has_is_loaded_before_the_epp_answers(envoy_stack, sim_server):
    """The endpoint picker loads a LoRA adapter no replica has (vLLM's runtime adapter API,
    through the routing core shared with the gateway) on one replica, then routes the
    request there: Envoy's answer comes from that adapter, and only that replica has it."""
    lora = dataclasses.replace(sim_profiles.get("tiny-cpu"), name="tiny-lora", max_loras=2)
    replicas = [sim_server(served_model_name="tiny", profile=lora) for _ in range(2)]
    stack = envoy_stack([{"name": "tiny", "endpoints": replicas,
                          "adapters": {"sql": "/adapters/sql"}}])  # fmt: skip
    assert [_registered(r) for r in replicas] == [set(), set()]
    body = {"model": "sql", "prompt": "select", "max_tokens": 2}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=20)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "sql"
    assert sorted(len(_registered(r)) for r in replicas) == [0, 1]
    assert stack.metric("kubellm_gateway_adapter_loads_total", adapter="sql", outcome="ok") == 1
    assert (
        stack.metric("kubellm_gateway_adapter_requests_total", adapter="sql", route="loaded") == 1
    )
    again = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=20)
    assert again.status_code == 200
    assert stack.metric("kubellm_gateway_adapter_loads_total", adapter="sql", outcome="ok") == 1


def _registered(url: str) -> set[str]:
    cards = httpx.get(f"{url}/v1/models", timeout=5).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


class ScriptedReplica:
    """A replica on a raw socket: it answers a completion with stream headers and one
    chunk, then holds the connection until `drop` is set and drops it (a crash
    mid-stream); `/metrics` and other GETs get an empty 200, so it stays routable."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.drop = threading.Event()
        self.hold = 10.0  # the longest it holds the connection without `drop`
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        self.server.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            request = conn.recv(65536)
            if request.startswith(b"GET"):
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                return
            chunk = b'data: {"choices": [{"text": "one", "index": 0}]}\n\n'
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n"
                         + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")  # fmt: skip
            self.drop.wait(self.hold)
            conn.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def scripted() -> Iterator[ScriptedReplica]:
    replica = ScriptedReplica()
    replica.thread.start()
    yield replica
    replica.drop.set()
    replica.stop.set()
    replica.thread.join(timeout=5)
    replica.server.close()


def test_replica_dying_mid_stream_ends_the_clients_stream_with_an_error(envoy_stack, scripted):
    stack = envoy_stack([{"name": "tiny", "endpoints": [scripted.url]}])
    received = b""
    with (
        pytest.raises(httpx.HTTPError),
        httpx.stream(
            "POST", f"{stack.url}/v1/completions", json={**BODY, "stream": True}, timeout=10
        ) as response,
    ):
        assert response.status_code == 200
        for part in response.iter_bytes():
            received += part
            scripted.drop.set()  # the replica dies after the first chunk arrived
    assert b"one" in received and b"[DONE]" not in received
    wait_until(lambda: stack.metric("kubellm_gateway_pending_requests") == 0, 5,
               "the EPP to release the broken request")  # fmt: skip
    assert stack.metric("kubellm_gateway_requests_total", code="200") == 0


def test_grpc_health_services_the_protocol_names(envoy_stack, sims):
    stack = envoy_stack([{"name": "tiny", "endpoints": sims(1)}])
    port = stack.epp.command[stack.epp.command.index("--grpc-port") + 1]

    async def check() -> list[int]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            names = ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]
            answers = [await stub.Check(health_pb2.HealthCheckRequest(service=n), timeout=5)
                       for n in names]  # fmt: skip
            return [a.status for a in answers]

    assert asyncio.run(check()) == [health_pb2.HealthCheckResponse.SERVING] * 3


def test_overflow_goes_through_the_fallback_forwarder(envoy_stack, scripted, sim_server, tmp_path):
    """Every replica saturated: the EPP picks the fallback forwarder (a `kubellm gateway`
    serving the model's fallback alone, holding the API key), which calls the external API."""
    external = sim_server(served_model_name="hosted-model")  # stands for the external API
    fallback = {"url": f"{external}/v1", "model": "hosted-model", "apiKey": "sk-test",
                "triggers": ["saturated", "no-ready-replicas"]}  # fmt: skip
    forwarder_file = tmp_path / "forwarder.yaml"
    forwarder_file.write_text(yaml.safe_dump({"models": [{"name": "tiny", "fallback": fallback}]}))
    port = free_port()
    forwarder = Process("forwarder", [sys.executable, "-m", "kubellm.cli", "gateway", "--static",
                        str(forwarder_file), "--port", str(port)],
                        tmp_path / "forwarder.log").start()  # fmt: skip
    try:
        wait_until(
            lambda: responds(f"http://127.0.0.1:{port}/health"), START_TIMEOUT_S, "the forwarder"
        )
        stack = envoy_stack(
            [{"name": "tiny", "endpoints": [scripted.url], "fallback": fallback,
              "slo": {"ttftSeconds": 0.05}}],
            epp_args=("--max-in-flight", "1", "--fallback-forwarder", f"localhost:{port}"),
        )  # fmt: skip
        with httpx.stream("POST", f"{stack.url}/v1/completions", json={**BODY, "stream": True},
                          timeout=20) as held:  # fmt: skip
            chunks = held.iter_bytes()
            next(chunks)  # the only replica is now saturated (max in flight 1)
            overflow = httpx.post(f"{stack.url}/v1/completions", json=BODY, timeout=20)
            scripted.drop.set()
        assert overflow.status_code == 200, overflow.text
        assert overflow.json()["model"] == "tiny"  # the forwarder renames the hosted model
        assert overflow.headers["x-kubellm-route"] == "fallback"
        assert _successes(external) == 1
        assert stack.metric("kubellm_gateway_fallback_requests_total", reason="saturated") == 1
        wait_until(lambda: stack.metric("kubellm_gateway_requests_total", target="fallback",
                   code="200") == 1, 5, "the EPP to count the fallback answer")  # fmt: skip
    finally:
        forwarder.stop()


def test_without_response_bodies_the_answer_counts_at_its_first_byte(envoy_stack, scripted):
    """Response body mode NONE (the cheapest) with the reference's request mode: Envoy
    closes the exchange with the EPP at the response headers, so the request is released
    and counted there, as an answer (not a broken stream); the in-flight count then covers
    queueing and prefill only."""
    stack = envoy_stack(
        [{"name": "tiny", "endpoints": [scripted.url]}],
        request_body_mode="FULL_DUPLEX_STREAMED", response_body_mode="NONE",
    )  # fmt: skip
    with httpx.stream(
        "POST", f"{stack.url}/v1/completions", json={**BODY, "stream": True}, timeout=20
    ) as held:
        chunks = held.iter_bytes()
        assert b"one" in next(chunks)
        wait_until(lambda: stack.metric("kubellm_gateway_requests_total", target="replica",
                   code="200") == 1, 5, "the answer counted at its headers")  # fmt: skip
        assert stack.metric("kubellm_gateway_pending_requests") == 0
        scripted.drop.set()
        with contextlib.suppress(httpx.HTTPError):
            for _ in chunks:
                pass


MESSAGES = "http.inference.ext_proc.stream_msgs_sent"  # Envoy's messages to the picker


def test_a_non_streamed_answer_ends_the_exchange_at_its_status_line(envoy_stack, sims):
    """The bootstrap's modes: for a non-streamed answer within its TTFT target the picker
    asks Envoy (ext_proc's mode override) to send no response body, so an exchange is
    three messages (request headers, request body, response headers) and the picker's
    answer to the last one is its end (the picker closes the stream; Envoy counts it
    closed by the processor and relays the body alone): counted once, whole, with its TTFT
    and goodput, the slot
    released (one request in flight at most: a slot left held would make the next one
    wait out its TTFT budget and get a 429). A stream is still followed event by event."""
    stack = envoy_stack(
        [{"name": "tiny", "endpoints": sims(1), "slo": {"ttftSeconds": 5}}],
        epp_args=("--max-in-flight", "1"),
    )
    for _ in range(3):
        response = httpx.post(f"{stack.url}/v1/completions", json=BODY, timeout=20)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]
    wait_until(lambda: stack.metric("kubellm_gateway_requests_total", target="replica",
               code="200") == 3, 5, "the EPP to count the answers")  # fmt: skip
    assert stack.envoy_stat(MESSAGES) == 3 * 3
    assert stack.metric("kubellm_gateway_time_to_first_token_seconds_count") == 3
    assert stack.metric("kubellm_gateway_slo_met_requests_total") == 3
    assert stack.metric("kubellm_gateway_pending_requests") == 0
    assert stack.metric("kubellm_gateway_request_duration_seconds_count") == 3

    client = _client(stack.url)
    stream = client.completions.create(model="tiny", prompt="count", max_tokens=6, stream=True)
    assert len([c for c in stream if c.choices and c.choices[0].text]) >= 2
    wait_until(lambda: stack.metric("kubellm_gateway_requests_total", target="replica",
               code="200") == 4, 5, "the EPP to count the stream")  # fmt: skip
    assert stack.envoy_stat(MESSAGES) > 3 * 3 + 3  # its body chunks went to the picker
    assert stack.metric("kubellm_gateway_inter_token_latency_seconds_count") >= 1


def test_a_non_streamed_exchange_ends_for_the_picker_with_its_status_line(envoy_stack, scripted):
    """The picker ends a non-streamed exchange whose body the core does not need at the
    response headers (it closes the ext_proc stream; Envoy relays the body alone): the
    request is counted and its slot freed while the replica is still sending the body.
    It waited for Envoy's close at the body's end before (issue 38: one message and its
    thread hops fewer per request)."""
    scripted.hold = 120.0  # the body does not end before the test's deadline
    stack = envoy_stack([{"name": "tiny", "endpoints": [scripted.url], "slo": {"ttftSeconds": 30}}])
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=BODY, timeout=60) as response:
        assert response.status_code == 200
        wait_until(lambda: stack.metric("kubellm_gateway_requests_total", code="200") == 1, 30,
                   "the picker to count the answer at its status line")  # fmt: skip
        assert stack.metric("kubellm_gateway_pending_requests") == 0
        scripted.drop.set()
