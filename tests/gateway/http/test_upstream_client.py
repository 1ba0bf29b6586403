"""The replicas' HTTP/1.1 client, against real loopback servers (asyncio.start_server)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from kubellm.gateway.http import relay as proxy
from kubellm.gateway.http import upstream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """A loopback server running `handler` per connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed: list[asyncio.Event] = []
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        closed = asyncio.Event()
        self.closed.append(closed)
        try:
            await self.handler(reader, writer)
        finally:
            closed.set()
            writer.close()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (by Content-Length); (b"", b"") at EOF."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return b"", b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[Server, str]]]]:
    servers: list[Server] = []

    async def start(handler: Handler) -> tuple[Server, str]:
        server = Server(handler)
        servers.append(server)
        return server, await server.start()

    yield start
    for server in servers:
        assert server.server is not None
        server.server.close()


async def test_chunked_body_split_across_reads(serve, monkeypatch):
    arrived = asyncio.Event()
    seen: list[bytes] = []

    async def handler(reader, writer):
        head, body = await read_request(reader)
        seen.append(head + body)
        # the header end, a chunk size line and the chunk data arrive in separate pieces,
        # each sent once the client has received the one before
        for piece in (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n",
            b"Content-Type: text/event-stream\r\n\r\n",
            b"6\r",
            b"\nhel",
            b"lo!\r",
        ):
            arrived.clear()
            writer.write(piece)
            await writer.drain()
            await asyncio.wait_for(arrived.wait(), 5)
        writer.write(b"\n5;ext=1\r\nworld\r\n0\r\nX-Trailer: 1\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client closes

    _, url = await serve(handler)
    pool = upstream.Pool(connect_timeout=5, deadlines=upstream.Deadlines(30, 30))
    original = upstream._Connection.data_received

    def data_received(self, data):
        original(self, data)
        arrived.set()

    monkeypatch.setattr(upstream._Connection, "data_received", data_received)
    try:
        response = await pool.post(f"{url}/v1/x", b'{"a":1}', {"content-type": "application/json"})
        assert response.status == 200
        assert response.headers["content-type"] == "text/event-stream"
        pieces = []
        while data := await response.readchunk():
            pieces.append(data)
        assert b"".join(pieces) == b"hello!world"
        response.close()
    finally:
        await pool.close()
    head = seen[0]
    assert head.startswith(b"POST /v1/x HTTP/1.1\r\n")
    assert b"Content-Length: 7\r\n" in head and head.endswith(b'\r\n\r\n{"a":1}')


async def test_keep_alive_reuses_a_fully_read_connection(serve):
    async def handler(reader, writer):
        while True:
            head, body = await read_request(reader)
            if not head:
                return
            if b"chunked" in head:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    server, url = await serve(handler)
    pool = upstream.Pool(connect_timeout=5, deadlines=upstream.Deadlines(30, 30))
    try:
        for body, headers in ((b"one", {}), (b"two", {"x-mode": "chunked"}), (b"three", {})):
            response = await pool.post(f"{url}/", body, headers)
            assert await response.read() == body
            response.close()
        assert server.connections == 1
    finally:
        await pool.close()


async def test_a_partly_read_answer_closes_its_connection(serve):
    async def handler(reader, writer):
        head, _ = await read_request(reader)
        if not head:
            return
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()  # the rest never comes; ends when the client closes

    server, url = await serve(handler)
    pool = upstream.Pool(connect_timeout=5, deadlines=upstream.Deadlines(30, 30))
    try:
        response = await pool.post(f"{url}/", b"x", {})
        assert await response.readchunk() == b"first"
        response.close()  # the client left mid-stream
        # not kept for reuse: the server sees the connection end, the next request opens one
        await asyncio.wait_for(server.closed[0].wait(), 5)
        second = await pool.post(f"{url}/", b"x", {})
        assert await second.readchunk() == b"first"
        second.close()
        assert server.connections == 2
    finally:
        await pool.close()


async def test_refused_connection_is_an_upstream_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        pool = upstream.Pool(connect_timeout=5, deadlines=upstream.Deadlines(30, 30))
        with pytest.raises(proxy.UPSTREAM_ERRORS):
            await pool.post(f"http://127.0.0.1:{port}/", b"x", {})
        await pool.close()


async def test_silence_past_the_read_timeout_fails_the_read(serve):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        await writer.drain()
        await reader.read()  # never sends the rest; ends when the client closes

    server, url = await serve(handler)
    pool = upstream.Pool(connect_timeout=5, deadlines=upstream.Deadlines(0.05, 0.05))
    try:
        response = await pool.post(f"{url}/", b"x", {})
        assert await response.readchunk() == b"half"
        with pytest.raises(upstream.ReadTimeout):
            await response.readchunk()
        assert isinstance(upstream.ReadTimeout("first byte", 1.0), proxy.UPSTREAM_ERRORS)
        response.close()
        await asyncio.wait_for(server.closed[0].wait(), 5)  # the timed-out connection was closed
    finally:
        await pool.close()


async def test_a_body_cut_short_is_an_upstream_error(serve):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        await writer.drain()

    _, url = await serve(handler)
    pool = upstream.Pool(connect_timeout=5, deadlines=upstream.Deadlines(30, 30))
    try:
        response = await pool.post(f"{url}/", b"x", {})
        with pytest.raises(proxy.UPSTREAM_ERRORS):
            await response.read()
        response.close()
    finally:
        await pool.close()


async def test_a_stale_kept_alive_connection_is_replaced(serve):
    async def handler(reader, writer):
        _, body = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        # the next request on this connection finds it closing (as after an idle timeout):
        # read, never answered
        await read_request(reader)

    server, url = await serve(handler)
    pool = upstream.Pool(connect_timeout=5, deadlines=upstream.Deadlines(30, 30))
    try:
        first = await pool.post(f"{url}/", b"one", {})
        assert await first.read() == b"one"
        first.close()
        second = await pool.post(f"{url}/", b"two", {})
        assert await second.read() == b"two"
        second.close()
        assert server.connections == 2
    finally:
        await pool.close()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer each request on a kept-alive connection with its own body."""
    while True:
        head, body = await read_request(reader)
        if not head:
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()


async def burst(pool: upstream.Pool, url: str, bodies: list[bytes]) -> list[bytes]:
    """Send `bodies` at once (one connection each, as none is idle); read and close all."""
    answers = await asyncio.gather(*(pool.post(f"{url}/", body, {}) for body in bodies))
    read = []
    for answer in answers:
        read.append(await answer.read())
        answer.close()
    return read


class Clock:
    """The pool's idle-expiry clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def closed_count(server: Server, expected: int) -> None:
    """Wait (bounded) until `expected` of the server's connections have ended."""
    async with asyncio.timeout(5):
        while sum(e.is_set() for e in server.closed) < expected:
            await asyncio.sleep(0.01)


async def test_a_connection_idle_past_the_idle_timeout_is_closed_not_reused(serve):
    server, url = await serve(echo)
    clock = Clock()
    pool = upstream.Pool(5, upstream.Deadlines(30, 30), idle_timeout=4.0, clock=clock)
    try:
        # two at once: two connections, both pooled afterwards
        assert await burst(pool, url, [b"a", b"b"]) == [b"a", b"b"]
        assert server.connections == 2
        clock.now += 5.0  # idle for 5 s, past the 4 s timeout
        third = await pool.post(f"{url}/", b"c", {})
        assert await third.read() == b"c"
        third.close()
        assert server.connections == 3  # a new connection, not an expired one
        await closed_count(server, 2)  # the expired ones are closed, so the engine frees them
        fourth = await pool.post(f"{url}/", b"d", {})  # within the timeout: reused
        assert await fourth.read() == b"d"
        fourth.close()
        assert server.connections == 3
    finally:
        await pool.close()


async def test_returning_a_connection_drops_expired_ones_left_behind(serve):
    server, url = await serve(echo)
    clock = Clock()
    pool = upstream.Pool(5, upstream.Deadlines(30, 30), idle_timeout=4.0, clock=clock)
    try:
        await burst(pool, url, [b"x"] * 3)  # three pooled at t=0
        clock.now = 3.0
        again = await pool.post(f"{url}/", b"y", {})  # the newest, back in the pool at t=3
        await again.read()
        again.close()
        clock.now = 4.5  # the two left at t=0 have expired; the one from t=3 has not
        last = await pool.post(f"{url}/", b"z", {})
        await last.read()
        last.close()  # coming back, it drops the expired ones behind it
        await closed_count(server, 2)
        assert server.connections == 3
    finally:
        await pool.close()


async def test_engines_are_told_who_asks_and_to_send_the_body_uncompressed(serve):
    heads: list[bytes] = []

    async def handler(reader, writer):
        while True:
            head, _ = await read_request(reader)
            if not head:
                return
            heads.append(head.lower())
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()

    _, url = await serve(handler)
    pool = upstream.Pool(connect_timeout=5, deadlines=upstream.Deadlines(30, 30))
    try:
        for headers in ({}, {"User-Agent": "mine", "accept-encoding": "br"}):
            response = await pool.post(f"{url}/", b"x", headers)
            await response.read()
            response.close()
    finally:
        await pool.close()
    default, given = heads
    assert b"\r\nuser-agent: kubellm-gateway/" in default
    assert b"\r\naccept-encoding: identity\r\n" in default
    assert given.count(b"user-agent:") == 1 and b"user-agent: mine\r\n" in given
    assert given.count(b"accept-encoding:") == 1 and b"accept-encoding: br\r\n" in given


async def test_an_interim_1xx_answer_is_skipped_and_the_connection_kept(serve):
    async def handler(reader, writer):
        while True:
            head, body = await read_request(reader)
            if not head:
                return
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    server, url = await serve(handler)
    pool = upstream.Pool(connect_timeout=5, deadlines=upstream.Deadlines(30, 30))
    try:
        for body in (b"one", b"two"):
            response = await pool.post(f"{url}/", body, {})
            assert response.status == 200 and await response.read() == body
            response.close()
        assert server.connections == 1
    finally:
        await pool.close()


async def test_bytes_arriving_on_a_pooled_connection_poison_it(serve):
    go = asyncio.Event()

    async def handler(reader, writer):
        _, body = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await go.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nLEAKED")  # unrequested
        await writer.drain()
        await echo(reader, writer)

    server, url = await serve(handler)
    pool = upstream.Pool(connect_timeout=5, deadlines=upstream.Deadlines(30, 30))
    try:
        first = await pool.post(f"{url}/", b"one", {})
        assert await first.read() == b"one"
        first.close()  # clean so far: pooled
        go.set()
        await asyncio.wait_for(server.closed[0].wait(), 5)  # the gateway closed it
        second = await pool.post(f"{url}/", b"two", {})
        assert await second.read() == b"two"  # its own answer, on a new connection
        second.close()
        assert server.connections == 2
    finally:
        await pool.close()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\n" + b"x-big: " + b"v" * 200_000 + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-%d: v\r\n" % i for i in range(500)) + b"\r\n",
    ],
    ids=["one giant header", "too many headers"],
)
async def test_an_oversized_head_is_refused(serve, head):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(head)
        await writer.drain()
        await reader.read()

    _, url = await serve(handler)
    pool = upstream.Pool(connect_timeout=5, deadlines=upstream.Deadlines(30, 30))
    try:
        with pytest.raises(upstream.UpstreamError, match=r"head|headers"):
            await pool.post(f"{url}/", b"x", {})
    finally:
        await pool.close()
