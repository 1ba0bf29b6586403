"""Hostile clients: slow or never-finished requests and piles of idle connections are
bounded, and legitimate clients are still served."""

from __future__ import annotations

import select
import socket
import time

import httpx

from tests.fixtures.engines import free_port, wait_until

BODY = b'{"model": "m", "prompt": "hi", "max_tokens": 2}'


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.settimeout(10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """What the gateway sends until it closes (bounded by the socket's 10 s timeout)."""
    chunks = []
    try:
        while data := sock.recv(65536):
            chunks.append(data)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def test_slow_or_unfinished_requests_are_cut_off(engines, gateway_process):
    ((engine, server),) = engines(1)
    gw = gateway_process(
        [{"name": "m", "endpoints": [server.url]}],
        "--header-timeout", "0.5", "--body-timeout", "0.5",
    )  # fmt: skip
    connect_only = connect(gw.url)
    partial_head = connect(gw.url)
    partial_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    trickle = connect(gw.url)  # a header line every 0.2 s never finishes the head
    partial_body = connect(gw.url)
    partial_body.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY[:10])
    )
    start = time.monotonic()
    trickled = 0
    try:  # a header line every 0.2 s, until the gateway cuts the connection off
        for i in range(50):
            trickle.sendall(b"x-slow-%d: 1\r\n" % i if i else b"POST /v1/completions HTTP/1.1\r\n")
            trickled += 1
            closed, _, _ = select.select([trickle], [], [], 0.2)  # readable: cut off
            if closed:
                break
    except OSError:
        pass
    assert trickled < 50
    assert read_all(connect_only) == b""  # closed without an answer
    assert read_all(partial_head) == b""
    assert read_all(trickle) == b""
    answer = read_all(partial_body)
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in answer
    assert time.monotonic() - start < 10  # every one was cut, none waited out the socket
    # the gateway still serves, and the engine saw none of them
    ok = httpx.post(f"{gw.url}/v1/completions", content=BODY, timeout=10)
    assert ok.status_code == 200 and len(engine.bodies) == 1


def test_connections_over_the_cap_get_a_fast_503_and_are_counted(engines, gateway_process):
    ((engine, server),) = engines(1)
    metrics_port = free_port()
    gw = gateway_process(
        [{"name": "m", "endpoints": [server.url]}],
        "--max-connections", "20", "--header-timeout", "30",
        "--metrics-port", str(metrics_port),
    )  # fmt: skip
    held = [connect(gw.url) for _ in range(20)]
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    refused = "kubellm_gateway_connections_refused_total"
    for _ in range(10):  # over the cap: answered 503 at once and closed
        extra = connect(gw.url)
        answer = read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer
        extra.close()
    text = httpx.get(metrics, timeout=5).text
    assert f"{refused} 10.0" in text
    for sock in held:
        sock.close()
    wait_until(
        lambda: httpx.post(f"{gw.url}/v1/completions", content=BODY, timeout=5).status_code == 200,
        10,
        "a legitimate client to be served once the held connections closed",
    )
    assert engine.bodies
    assert httpx.get(f"{gw.url}/metrics", timeout=5).status_code == 404  # on its own port
