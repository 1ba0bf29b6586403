"""The completion routes answer alike under the gateway's own server and under another.

`kubellm gateway` serves with uvicorn's protocol guarded by `http.server` (header timer
armed only for a head still incomplete after a read; the connection's end reported to the
request by a callback, `server.ConnectionLost`); under any other ASGI server the request
learns that its client left from a watcher task on `receive`. Each case runs on both, and
the answers (status, error fields) must be the same.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from kubellm.gateway.discovery.base import FixedDiscovery
from kubellm.gateway.http import server as gateway_server
from kubellm.gateway.http.app import Gateway, GatewaySettings, create_app
from kubellm.gateway.http.settings import ClientLimits
from kubellm.gateway.routing.scheduler import SchedulerSettings
from uvicorn.protocols.http.flow_control import FlowControl

from tests.fixtures.polling import wait_until
from tests.fixtures.servers import ServerThread
from tests.gateway.conftest import GatewayHandle, model

SERVERS = ("kubellm", "uvicorn")
CHAT = [{"role": "user", "content": "hello"}]
BIG = "x" * 5000  # over the gateways' 4,096-byte body limit
LABELS = {"model": "tiny", "deployment": "tiny", "namespace": "default"}


@pytest.fixture
def served(engines) -> Iterator[Callable[..., tuple[Any, dict[str, GatewayHandle]]]]:
    """One engine, and a gateway over it on each server (`SERVERS`)."""
    started: list[ServerThread] = []

    def start(**settings: Any) -> tuple[Any, dict[str, GatewayHandle]]:
        ((engine, upstream),) = engines(1)
        handles = {}
        for name in SERVERS:
            discovery = FixedDiscovery({"tiny": model("tiny", [upstream])})
            gw = Gateway(
                discovery,
                GatewaySettings(scheduler=SchedulerSettings(scrape_interval=0.05), **settings),
            )
            http = "auto"
            if name == "kubellm":  # as `kubellm gateway` serves (gateway/cli.py)
                http = gateway_server.guarded_protocol(ClientLimits(header_timeout=0.5), lambda: 0)
            thread = ServerThread(create_app(gw), http=http).start()
            started.append(thread)
            handles[name] = GatewayHandle(gw, discovery, thread)
        return engine, handles

    yield start
    for thread in started:
        thread.stop()


def _answer(response: httpx.Response) -> tuple[int, Any]:
    """What a client reads of an answer, less what differs per request (ids, times)."""
    body = response.json()
    if "error" in body:
        return response.status_code, {k: body["error"][k] for k in ("type", "code", "param")}
    return response.status_code, [c["message"] for c in body["choices"]]


CASES: list[tuple[str, dict[str, Any], int]] = [
    ("good", {"json": {"model": "tiny", "messages": CHAT}}, 200),
    ("bad json", {"content": b'{"model": "tiny", "messages": '}, 400),
    ("field wrong", {"json": {"model": "tiny", "messages": "hello"}}, 400),
    ("unknown model", {"json": {"model": "nope", "messages": CHAT}}, 404),
    ("too large", {"json": {"model": "tiny", "messages": [{"role": "user", "content": BIG}]}}, 413),
]  # fmt: skip


def test_every_answer_is_the_same_on_both_servers(served):
    engine, gateways = served(max_body_bytes=4096)
    for name, request, status in CASES:
        answers = {
            server: _answer(httpx.post(f"{gw.url}/v1/chat/completions", timeout=20, **request))
            for server, gw in gateways.items()
        }
        assert answers["kubellm"] == answers["uvicorn"], name
        assert answers["kubellm"][0] == status, (name, answers)
    assert len(engine.bodies) == 2  # the good request, once through each


@pytest.mark.parametrize("server", SERVERS)
def test_a_client_leaving_mid_stream_cancels_the_upstream_request(served, server):
    engine, gateways = served()
    engine.behaviour.tokens = 1000
    engine.behaviour.token_delay = 0.05
    gw = gateways[server]
    body = {"model": "tiny", "messages": CHAT, "stream": True}
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as response,
    ):
        assert next(response.iter_lines()).startswith("data: ")
    # leaving the block closed the client's connection mid-stream
    wait_until(lambda: engine.cancelled == 1, 30, "the engine to see the cancellation")
    assert engine.completed == 0
    wait_until(lambda: gw.gateway.scheduler.in_flight() == {}, 30, "the slot to be freed")
    wait_until(lambda: gw.metric("kubellm_gateway_pending_requests", **LABELS) == 0, 30)


@pytest.mark.parametrize("server", SERVERS)
def test_a_client_leaving_before_the_answer_is_counted_499(served, server):
    engine, gateways = served()
    engine.behaviour.first_byte_delay = 30
    gw = gateways[server]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{gw.url}/v1/chat/completions", json={"model": "tiny", "messages": CHAT}, timeout=0.5
        )
    wait_until(lambda: gw.gateway.scheduler.in_flight() == {}, 30, "the upstream request to close")
    wait_until(
        lambda: (
            gw.metric("kubellm_gateway_requests_total", **LABELS, target="none", code="499") == 1
        ),
        30,
    )


NEVER_ENDS = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    b'content-length: 100\r\n\r\n{"model": '
)


def _until(sock: socket.socket, marker: bytes) -> bytes:
    """What the socket reads until `marker` (or its end), bounded by its timeout."""
    answer = b""
    while marker not in answer and (data := sock.recv(65536)):
        answer += data
    return answer


@pytest.mark.parametrize("server", SERVERS)
def test_a_body_that_never_ends_gets_a_408(served, server):
    _, gateways = served(body_timeout=0.5)
    host, port = gateways[server].url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(NEVER_ENDS)
        answer = _until(sock, b"request_timeout")
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in answer


@pytest.mark.parametrize("server", SERVERS)
def test_a_body_that_never_ends_after_a_whole_request_on_the_connection_gets_a_408(served, server):
    """A body read whole skips its deadline (`server.BODY_BUFFERED`); the next request on
    the kept-alive connection, whose body never ends, is still cut at its deadline."""
    _, gateways = served(body_timeout=0.5)
    host, port = gateways[server].url.removeprefix("http://").split(":")
    whole = b'{"model": "nope", "prompt": "hi"}'
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(whole), whole)
        )
        assert _until(sock, b"model_not_found").startswith(b"HTTP/1.1 404 ")
        sock.sendall(NEVER_ENDS)
        answer = _until(sock, b"request_timeout")
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in answer


def test_a_head_trickled_over_the_header_timeout_is_cut_on_a_kept_alive_connection(served):
    """The header timer is armed once a read leaves a head incomplete: a second request
    on a kept-alive connection whose head never ends is cut off too."""
    _, gateways = served()
    host, port = gateways["kubellm"].url.removeprefix("http://").split(":")
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        first = b""
        while b"\r\n\r\n" not in first:
            first += sock.recv(65536)
        head, _, rest = first.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(rest) < length:  # the whole answer, before the next request
            rest += sock.recv(65536)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
        received = b""
        while data := sock.recv(65536):  # bounded by the socket's timeout
            received += data
    assert received == b""  # closed, no answer


def _post_whole(sock: socket.socket, body: bytes) -> bytes:
    """Send one request on `sock` and read its whole answer (its head: content-length)."""
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
        b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    first = b""
    while b"\r\n\r\n" not in first:
        data = sock.recv(65536)
        assert data, "closed before the answer"
        first += data
    head, _, rest = first.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(rest) < length:
        rest += sock.recv(65536)
    return head


def test_keep_alive_closes_an_idle_connection_and_never_a_busy_one(engines) -> None:
    """The keep-alive timeout counts from the last answer's end: a connection whose
    requests keep coming, each sooner than the timeout, stays open past it (one timer
    per connection looks again when it fires); an idle one is closed."""
    ((_, upstream),) = engines(1)
    gw = Gateway(FixedDiscovery({"tiny": model("tiny", [upstream])}), GatewaySettings())
    protocol = gateway_server.guarded_protocol(ClientLimits(), lambda: 0)
    thread = ServerThread(create_app(gw), http=protocol, timeout_keep_alive=3).start()
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'
    try:
        with socket.create_connection(("127.0.0.1", thread.port), timeout=30) as sock:
            # four answers over more than the timeout, each request ~1.1 s after the
            # previous answer (pacing the client, not waiting on the server)
            for _ in range(4):
                assert _post_whole(sock, body).startswith(b"HTTP/1.1 200 ")
                time.sleep(1.1)
            assert _post_whole(sock, body).startswith(b"HTTP/1.1 200 ")
            sock.settimeout(20)
            assert sock.recv(65536) == b""  # idle now: closed (bounded by the timeout)
    finally:
        thread.stop()


def test_connection_lost_runs_each_watcher_once():
    lost = gateway_server.ConnectionLost()
    calls: list[str] = []
    lost.watch(lambda: calls.append("a"))
    gone = lambda: calls.append("gone")  # noqa: E731
    lost.watch(gone)
    lost.unwatch(gone)
    lost.fire()
    lost.fire()
    assert calls == ["a"]
    lost.watch(lambda: calls.append("late"))  # after the end: at once
    assert calls == ["a", "late"]


def test_the_access_log_is_kept_where_its_level_shows_it():
    """uvicorn's access log formats each request's address and path even where the level
    then drops the record: `server.config` turns it off there, and only there."""
    import logging

    for level, shown in (
        ("warning", False), (logging.ERROR, False), ("debug", True), (logging.INFO, True),
        (None, True), ("info", True),
    ):  # fmt: skip
        kwargs = {} if level is None else {"log_level": level}
        config = gateway_server.config(lambda *a: None, ClientLimits(), lambda: None, **kwargs)
        assert config.access_log is shown, level
        assert logging.getLogger("uvicorn.access").hasHandlers() is shown, level


def test_proxy_headers_still_apply_to_the_routes_that_read_them():
    """Without an access log, uvicorn's proxy-headers middleware wraps what Starlette
    serves, not the completion routes' raw handler (which reads neither the client's
    address nor the scheme): a redirect behind a trusted TLS proxy still says https."""
    import asyncio

    async def location(app: Any) -> str:
        transport = httpx.ASGITransport(app, client=("127.0.0.1", 4321))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            response = await client.get("/v1/models/", headers={"x-forwarded-proto": "https"})
        assert response.status_code == 307
        return response.headers["location"]

    for level, proxied in (("warning", False), ("info", True)):
        app = create_app(Gateway(FixedDiscovery({})))
        config = gateway_server.config(app, ClientLimits(), lambda: None, log_level=level)
        assert config.proxy_headers is proxied, level  # uvicorn's own, around everything
        config.load()
        assert asyncio.run(location(config.loaded_app)) == "https://gw/v1/models", level


class _Transport:
    """What a response cycle writes, write by write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, parts: Any) -> None:
        self.writes.append(b"".join(parts))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


SCOPE = {
    "type": "http", "http_version": "1.1", "path": "/v1/chat/completions", "root_path": "",
    "raw_path": b"/v1/chat/completions",
    "query_string": b"", "client": ("127.0.0.1", 5000), "headers": [],
}  # fmt: skip


def _cycle(
    keep_alive: bool = True, method: str = "POST", access_log: bool = False
) -> tuple[Any, _Transport, list[int]]:
    transport, answered = _Transport(), []
    cycle = gateway_server.WholeCycle(
        scope={**SCOPE, "method": method},  # type: ignore[typeddict-item]
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=access_log,
        default_headers=[(b"server", b"uvicorn"), (b"date", b"Fri, 04 Dec 2026 16:00:00 GMT")],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: answered.append(1),
    )
    return cycle, transport, answered


WHOLE = b'{"id": "c", "choices": []}'


def _headers(length: int) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-kubellm-route", b"replica"),
        (b"content-length", str(length).encode()),
        (b"content-type", b"application/json"),
    ]


@pytest.mark.parametrize(
    ("keep_alive", "access_log"), [(True, False), (False, False), (True, True)]
)
def test_a_whole_answer_is_uvicorns_bytes_in_one_write(
    keep_alive: bool, access_log: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async def both() -> None:
        caplog.set_level(logging.INFO, logger="test.access")
        cycle, transport, answered = _cycle(keep_alive, access_log=access_log)
        assert cycle.send_whole(200, _headers(len(WHOLE)), WHOLE)
        logged = [r.getMessage() for r in caplog.records]
        caplog.clear()
        reference, written, reference_answered = _cycle(keep_alive, access_log=access_log)
        await reference.send(
            {"type": "http.response.start", "status": 200, "headers": _headers(len(WHOLE))}
        )
        await reference.send({"type": "http.response.body", "body": WHOLE})
        assert len(written.writes) == 2  # uvicorn's own: head, then body
        assert logged == [r.getMessage() for r in caplog.records]
        assert len(logged) == (1 if access_log else 0)
        assert transport.writes == [b"".join(written.writes)]  # the same bytes, one write
        assert (cycle.response_complete, transport.closed, answered) == (
            reference.response_complete, written.closed, reference_answered,
        )  # fmt: skip
        assert cycle.message_event.is_set()
        # a second answer on the same cycle is refused, as uvicorn's send would refuse it
        assert not cycle.send_whole(200, _headers(len(WHOLE)), WHOLE)

    asyncio.run(both())


@pytest.mark.parametrize(
    ("case", "headers", "method"),
    [
        ("length differs from the body's", _headers(len(WHOLE) + 1), "POST"),
        ("no length", _headers(len(WHOLE))[::2], "POST"),
        ("framing header", [*_headers(len(WHOLE)), (b"transfer-encoding", b"chunked")], "POST"),
        ("connection header", [*_headers(len(WHOLE)), (b"connection", b"close")], "POST"),
        ("invalid header value", [*_headers(len(WHOLE)), (b"x-a", b"a\r\nb")], "POST"),
        ("invalid header name", [*_headers(len(WHOLE)), (b"x a", b"b")], "POST"),
        ("HEAD", _headers(len(WHOLE)), "HEAD"),
    ],
)
def test_what_send_whole_does_not_send_is_left_to_uvicorn_untouched(
    case: str, headers: list[tuple[bytes, bytes]], method: str
) -> None:
    async def one() -> None:
        cycle, transport, answered = _cycle(method=method)
        assert not cycle.send_whole(200, headers, WHOLE), case
        assert (transport.writes, cycle.response_started, answered) == ([], False, [])

    asyncio.run(one())


def test_the_header_line_table_stays_bounded_under_distinct_values() -> None:
    """Answers carrying a distinct header value each (an echoed request id) are still
    uvicorn's bytes, and the table of encoded header lines never holds more than its cap."""

    async def many() -> None:
        cap = gateway_server._LINES_MAX
        for i in range(cap * 2 + 5):
            headers = [*_headers(len(WHOLE)), (b"x-request-id", b"id-%d" % i)]
            cycle, transport, _ = _cycle()
            assert cycle.send_whole(200, headers, WHOLE)
            assert len(gateway_server._LINES) <= cap
            if i % 97 == 0:  # the same bytes as uvicorn's own send, now and then
                reference, written, _ = _cycle()
                await reference.send(
                    {"type": "http.response.start", "status": 200, "headers": headers}
                )
                await reference.send({"type": "http.response.body", "body": WHOLE})
                assert transport.writes == [b"".join(written.writes)]

    asyncio.run(many())


def test_a_whole_answer_is_not_sent_past_a_paused_or_gone_client() -> None:
    async def one() -> None:
        cycle, transport, _ = _cycle()
        cycle.flow.write_paused = True  # the client is not reading: uvicorn's send waits
        assert not cycle.send_whole(200, _headers(len(WHOLE)), WHOLE)
        cycle.flow.write_paused, cycle.disconnected = False, True
        assert not cycle.send_whole(200, _headers(len(WHOLE)), WHOLE)
        assert transport.writes == []

    asyncio.run(one())


def test_the_gateways_server_answers_whole_in_one_write(served) -> None:
    """Through the gateway's server an answer the gateway holds whole (read in one piece
    from the replica, or assembled) leaves in one send (the answer itself is the same as
    under plain uvicorn: the first test above). An answer the replica sends in pieces is
    relayed as it comes, so requests are sent until one was held whole (at most 20)."""
    _, handles = served()
    sent: list[bool] = []
    original = gateway_server.WholeCycle.send_whole

    def counted(self: Any, *args: Any) -> bool:
        done = original(self, *args)
        sent.append(done)
        return done

    gateway_server.WholeCycle.send_whole = counted  # type: ignore[method-assign]
    try:
        with httpx.Client(base_url=handles["kubellm"].url, timeout=30) as client:
            for _ in range(20):
                body = {"model": "tiny", "messages": CHAT}
                response = client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200
                assert response.json()["choices"][0]["message"]["content"]
                if sent:  # appended just after the write: a second request may go first
                    break
    finally:
        gateway_server.WholeCycle.send_whole = original  # type: ignore[method-assign]
    assert sent and all(sent)
