"""The gateway's HTTP/1.1 client for engine replicas: keep-alive, framed by llhttp.

Every byte a replica sends is framed by llhttp (through `httptools`, the parser
uvicorn serves with), never by string handling here. A replica is a peer the
gateway does not control, so:

- **An answer must be the one to its request**: each request carries a unique
  `x-request-id` (the caller's), which vLLM (`--enable-request-id-headers`, set by the
  launcher) and the simulator echo; an answer echoing another id is refused. This
  closes the race no framing check can: an unrequested answer that arrives just after
  the next request went out on the same connection.
- **A connection is reused only when provably clean**: its previous response was
  parsed to its end, nothing arrived after that end (not in the same read, not
  while it sat in the pool), the server did not ask to close, and it is not
  half-closed. Bytes after a response, or while idle, poison the connection: it
  is closed, and no later request can ever read them as its own answer.
- **Any framing violation** (a bad status line, header or chunk size, bytes the
  parser rejects) fails the response with `UpstreamError` and closes the
  connection; the caller answers its client with an error, never those bytes.
- **Bounds**: the status line and headers together at most `max_head_bytes` and
  `max_headers` lines; a body read whole (`read`) at most `max_body_bytes`; one
  piece handed to the caller at most `_MAX_PIECE`; the receive buffer stops the
  socket above `_HIGH_WATER`.
- **Timeouts per stage** (`Deadlines`): connect; the first body byte (a streamed
  answer's first event comes after prefill; a non-streamed answer comes whole, so
  its caller passes the total budget); the longest silence between two pieces
  after that; and the whole response. One timer per response checks them.

Plain `http://` only (https replicas, the fallback API and scraping use aiohttp).
Requests are POSTs written in one `transport.write`: status line, headers, body.
`User-Agent: kubellm-gateway/VERSION` and `Accept-Encoding: identity` are added
unless the caller sends its own (the body is relayed as it comes, uncompressed).
A connection idle for `idle_timeout` seconds (4 s, under uvicorn's 5 s keep-alive,
which vLLM's server uses) is closed rather than reused.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
from kubellm.gateway.http.settings import Deadlines

from kubellm import __version__

_SKIPPED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
_HIGH_WATER = 256 * 1024  # body bytes buffered before the socket stops being read
_MAX_PIECE = 64 * 1024  # the most one `readchunk` returns, however large a chunk is
_DEFAULT_HEADERS = {"user-agent": f"kubellm-gateway/{__version__}", "accept-encoding": "identity"}


class UpstreamError(Exception):
    """The upstream failed: refused, reset or closed early, a malformed or oversized answer."""


class ReadTimeout(UpstreamError, TimeoutError):
    """A stage's timeout passed while the gateway waited for the upstream."""

    def __init__(self, stage: str, seconds: float) -> None:
        super().__init__(f"no {stage} within {seconds:g} s")
        self.stage = stage


class ConnectFailed(UpstreamError):
    """The connection could not be opened (refused, unreachable, or timed out)."""


@dataclass(frozen=True)
class Limits:
    """What one upstream answer may be: sizes the gateway holds in memory."""

    max_head_bytes: int = 64 * 1024
    max_headers: int = 100
    max_body_bytes: int = 32 * 1024 * 1024  # a non-streamed answer read whole


class _Connection(asyncio.Protocol):
    """One TCP connection: llhttp's callbacks fill the current response's state."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, key: tuple[str, int], limits: Limits
    ) -> None:
        self.loop = loop
        self.key = key
        self.limits = limits
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.error: BaseException | None = None
        self.idle_since = 0.0
        # the response being read
        self.active = False  # a request is out and its answer not yet parsed to its end
        self.complete = False  # the answer was parsed to its end
        self.interim = False  # parsing a 1xx interim answer; the real one follows
        self.head_done = False
        self.head_bytes = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.pieces: deque[bytes] = deque()
        self.buffered = 0
        self.until_close = False  # no length, not chunked: the body ends when the peer closes
        self.keep_alive = False  # the answer's head allows another request on this connection
        self.chunked = False  # pieces are handed out per HTTP chunk; else as they arrive
        self.expect_id: bytes | None = None  # the x-request-id sent: an answer must echo it
        self._chunk: list[bytes] = []  # the current HTTP chunk's data, not yet handed out
        self._chunk_size = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadlines = Deadlines()
        self._sent_at = 0.0
        self._last = 0.0  # when the last body bytes arrived
        self._got_body = False
        self._rearm = False  # the first body bytes came in the read being parsed

    # -------------------------------------------------------------- transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        if not self.active:  # bytes nobody asked for: poisoned, never reused
            self._fail(UpstreamError("bytes arrived outside any response"))
            return
        if not self.head_done:
            self.head_bytes += len(data)
            if self.head_bytes > self.limits.max_head_bytes + _MAX_PIECE:
                self._fail(UpstreamError("response head exceeds the limit"))
                return
        try:
            self.parser.feed_data(data)
            if not self.chunked:
                self._flush_chunk()
            if self._rearm:
                self._rearm = False
                self._idle_deadline()
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("protocol upgrade refused"))
        except httptools.HttpParserError as error:
            if self.error is None:
                self._fail(UpstreamError(f"malformed answer: {error}"))
            else:
                self._fail(self.error)
        self._wake()

    def eof_received(self) -> bool:
        if self.active and self.until_close and self.head_done:
            self._flush_chunk()
            self._message_done()
        self._close_transport()
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.active and not self.complete and self.error is None:
            self.error = UpstreamError(
                f"connection lost: {exc!r}" if exc else "connection closed before the answer ended"
            )
        self.closed = True
        self._stop_timer()
        self._wake()

    # -------------------------------------------------------------- llhttp callbacks

    def on_message_begin(self) -> None:
        if self.complete or self.head_done:  # a second answer to one request: poisoned
            raise self._set_error(UpstreamError("more than one answer to one request"))

    def on_status(self, status: bytes) -> None:
        pass

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        if len(self.headers) > self.limits.max_headers:
            raise self._set_error(UpstreamError("too many response headers"))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx: an interim answer; the real one follows
            self.headers = []
            self.interim = True
            return
        size, framed, chunked, given = 0, False, False, None
        for name, value in self.headers:  # one pass: size, the framing, the echoed id
            size += len(name) + len(value) + 4
            lower = name.lower()
            if lower == b"transfer-encoding":
                framed = True
                chunked = chunked or b"chunked" in value.lower()
            elif lower == b"content-length":
                framed = True
            elif lower == b"x-request-id" and given is None:
                given = value
        if size > self.limits.max_head_bytes:
            raise self._set_error(UpstreamError("response headers exceed the limit"))
        if given is not None and self.expect_id is not None and given != self.expect_id:
            raise self._set_error(UpstreamError("an answer to another request"))
        self.status = status
        self.head_done = True
        self.keep_alive = self.parser.should_keep_alive()
        self.chunked = chunked
        self.until_close = status not in (204, 304) and not framed

    def on_body(self, body: bytes) -> None:
        self._last = self.loop.time()
        if not self._got_body:
            # the first byte: the idle deadline now, if it is sooner; set once this read
            # is parsed (`data_received`), so an answer that ends in the read that brought
            # its first byte (most whole answers) re-arms no timer
            self._got_body = self._rearm = True
        self._chunk.append(body)
        self._chunk_size += len(body)
        if self._chunk_size >= _MAX_PIECE:
            self._flush_chunk()

    def _idle_deadline(self) -> None:
        timer = self._timer
        if timer is not None and self._last + self._deadlines.idle < timer.when():
            self._arm(self._next_deadline()[0])

    def on_chunk_header(self) -> None:
        self._flush_chunk()

    def on_chunk_complete(self) -> None:
        self._flush_chunk()  # one HTTP chunk (usually one SSE event) is handed out whole

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self._flush_chunk()
        self._message_done()

    # -------------------------------------------------------------- state

    def _flush_chunk(self) -> None:
        if self._chunk_size:
            data = self._chunk[0] if len(self._chunk) == 1 else b"".join(self._chunk)
            self._chunk = []
            self._chunk_size = 0
            self.pieces.append(data)
            self.buffered += len(data)
            if self.buffered > _HIGH_WATER and not self._paused and self.transport is not None:
                self.transport.pause_reading()
                self._paused = True

    def _message_done(self) -> None:
        self.complete = True
        self._stop_timer()

    def _set_error(self, error: UpstreamError) -> UpstreamError:
        if self.error is None:
            self.error = error
        return error

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -------------------------------------------------------------- the request

    def send(self, request: bytes, deadlines: Deadlines, expect_id: bytes | None) -> None:
        """Write one request and start reading its answer under `deadlines`; an answer
        that echoes an `x-request-id` other than `expect_id` is refused."""
        assert self.transport is not None and not self.active
        self.expect_id = expect_id
        self.active, self.complete, self.head_done, self.interim = True, False, False, False
        self.head_bytes, self.status, self.until_close, self.chunked = 0, 0, False, False
        self.headers = []
        self._got_body = self._rearm = False
        self._deadlines = deadlines
        self._sent_at = self._last = self.loop.time()
        self.transport.write(request)
        self._arm(self._sent_at + min(deadlines.first_byte, deadlines.total))

    def _arm(self, when: float) -> None:
        self._stop_timer()
        if math.isfinite(when):
            self._timer = self.loop.call_at(when, self._check_deadlines)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _next_deadline(self) -> tuple[float, str, float]:
        d = self._deadlines
        total = self._sent_at + d.total
        if self._got_body:
            stage, seconds, when = "next chunk", d.idle, self._last + d.idle
        else:
            stage, seconds, when = "first byte", d.first_byte, self._sent_at + d.first_byte
        if total <= when:
            return total, "complete answer", d.total
        return when, stage, seconds

    def _check_deadlines(self) -> None:
        """One timer per response: re-armed at the next deadline while bytes keep coming."""
        self._timer = None
        if self.complete or self.closed:
            return
        when, stage, seconds = self._next_deadline()
        if self.loop.time() < when:
            self._arm(when)
            return
        if self.pieces and self._waiter is None:  # the reader is behind, not the peer
            self._arm(self.loop.time() + min(seconds, 1.0))
            return
        self._fail(ReadTimeout(stage, seconds))
        self._wake()

    async def wait(self) -> None:
        """Wait until the parser made progress, or the connection failed. Callers check
        for what they need before waiting: a failure raises only when nothing is left."""
        if self.error is not None:
            raise self.error
        if self.closed:
            raise UpstreamError("connection closed before the answer ended")
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        waiter = self._waiter = self.loop.create_future()
        await waiter  # the caller looks at what arrived; an error is raised on its next wait

    def take(self) -> bytes:
        """The next buffered piece (b"" if none)."""
        if not self.pieces:
            return b""
        data = self.pieces.popleft()
        self.buffered -= len(data)
        if self._paused and self.buffered < _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def take_all(self) -> bytes:
        """Every buffered piece, joined (b"" if none)."""
        pieces = self.pieces
        if len(pieces) < 2:
            return self.take()
        data = b"".join(pieces)
        pieces.clear()
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        """Clean: the answer parsed to its end, nothing left or after it, keep-alive."""
        return (
            self.complete
            and not self.closed
            and self.error is None
            and not self.pieces
            and not self.until_close
            and self.keep_alive
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def release(self) -> None:
        """The answer was read: ready for the pool (callers check `reusable` first)."""
        self.active = False
        self._stop_timer()

    def _close_transport(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        self._close_transport()


class Response:
    """An upstream answer: status and headers read; the body read with `readchunk`/`read`.

    Call `close()` when done: it returns the connection to the pool if the answer was
    read to its end and the connection is clean, and closes it otherwise.
    """

    __slots__ = ("_conn", "_headers", "_pool", "status")

    def __init__(self, conn: _Connection, pool: Pool) -> None:
        self._conn: _Connection | None = conn
        self._pool = pool
        self.status = conn.status
        self._headers: dict[str, str] | None = None

    @property
    def headers(self) -> dict[str, str]:
        """Lower-case names; for a repeated name, its first value."""
        if self._headers is None:
            out: dict[str, str] = {}
            conn = self._conn
            for name, value in conn.headers if conn is not None else ():
                out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
            self._headers = out
        return self._headers

    async def readchunk(self) -> bytes:
        """The next piece of the body as it arrives: one HTTP chunk's data (at most 64 KiB),
        so each event is relayed on its own; b"" at the end."""
        conn = self._conn
        if conn is None:
            raise UpstreamError("response already closed")
        while True:
            if conn.pieces:
                return conn.take()
            if conn.complete:
                return b""
            await conn.wait()

    async def readsome(self) -> bytes:
        """Whatever arrived of the body, all the pieces buffered joined (for a reader that
        needs no chunk boundaries: fewer, larger reads); b"" at the end."""
        conn = self._conn
        if conn is None:
            raise UpstreamError("response already closed")
        while True:
            if conn.pieces:
                return conn.take_all()
            if conn.complete:
                return b""
            await conn.wait()

    def ended(self) -> bool:
        """The body was read to its end (nothing buffered, the answer parsed whole)."""
        conn = self._conn
        return conn is not None and conn.complete and not conn.pieces

    async def read(self) -> bytes:
        """The whole (remaining) body, at most the pool's `max_body_bytes`."""
        limit = self._pool.limits.max_body_bytes
        parts, size = [], 0
        while data := await self.readchunk():
            size += len(data)
            if size > limit:
                self.close()
                raise UpstreamError(f"answer exceeds the limit of {limit} bytes")
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Pool the connection if the answer was read to its end and it is clean."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.reusable():
            conn.release()
            self._pool.put(conn)
        else:
            conn.close()


@functools.lru_cache(maxsize=4096)
def _split(url: str) -> tuple[tuple[str, int], str]:
    """A replica URL's (host, port) and the start of a POST to it (request line and Host
    header), parsed once per URL (the same few URLs take every request)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http:// URLs are supported, not {url!r}")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    host = parts.netloc.rsplit("@", 1)[-1]
    return (parts.hostname, parts.port or 80), f"POST {target} HTTP/1.1\r\nHost: {host}\r\n"


@functools.lru_cache(maxsize=256)
def _head_plan(names: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """For a request's header names: those sent as given (not the ones the pool sets
    itself), and the default headers it lacks with the head's end. The same few sets of
    names take every request, so this is worked out once per set."""
    given = {name.lower() for name in names}
    kept = tuple(name for name in names if name.lower() not in _SKIPPED_HEADERS)
    tail = "".join(f"{n}: {v}\r\n" for n, v in _DEFAULT_HEADERS.items() if n not in given)
    return kept, tail + "\r\n"


class Pool:
    """Keep-alive connections per host:port, and the requests sent over them."""

    def __init__(
        self,
        connect_timeout: float,
        deadlines: Deadlines | None = None,
        idle_timeout: float = 4.0,
        limits: Limits | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.clock = clock  # None: the event loop's; what idle expiry is measured by
        self.deadlines = deadlines or Deadlines()
        self.idle_timeout = idle_timeout
        self.limits = limits or Limits()
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}
        self._closed = False

    def put(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        now = conn.idle_since = self.clock() if self.clock else conn.loop.time()
        idle = self._idle.setdefault(conn.key, deque())
        idle.append(conn)
        # the oldest are at the left (connections are reused newest first): drop those
        # expired or closed by the server, so a pool after a burst does not keep them all
        while idle and (idle[0].closed or now - idle[0].idle_since > self.idle_timeout):
            idle.popleft().close()

    def _pooled(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be stale
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                conn.close()
                continue
            now = self.clock() if self.clock else conn.loop.time()
            if now - conn.idle_since > self.idle_timeout:
                conn.close()  # the newest has expired, so has every older one
                while idle:
                    idle.pop().close()
                return None
            return conn
        return None

    async def _connect(self, key: tuple[str, int], timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        limits = self.limits
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, key, limits), key[0], key[1]
                )
        except TimeoutError:
            raise ConnectFailed(
                f"cannot connect to {key[0]}:{key[1]} within {timeout:g} s"
            ) from None
        except OSError as error:  # refused, unreachable
            raise ConnectFailed(f"cannot connect to {key[0]}:{key[1]}: {error}") from error
        return conn

    async def post(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        deadlines: Deadlines | None = None,
        connect_timeout: float | None = None,
    ) -> Response:
        """Send `body` to `url`; return once the status line and headers have arrived."""
        key, start = _split(url)
        names, tail = _head_plan(tuple(headers))
        lines = [start, f"Content-Length: {len(body)}\r\n"]
        for name in names:
            lines.append(f"{name}: {headers[name]}\r\n")
        lines.append(tail)
        request = "".join(lines).encode("latin-1") + body
        given_id = headers.get("x-request-id")
        expect_id = given_id.encode("latin-1") if given_id else None
        deadlines = deadlines or self.deadlines

        conn = self._pooled(key)
        if conn is not None:
            try:
                return await self._exchange(conn, request, deadlines, expect_id)
            except UpstreamError as error:
                # a kept-alive connection the server had just closed: once more, afresh
                if isinstance(error, ReadTimeout) or conn.head_bytes:
                    raise
        timeout = self.connect_timeout if connect_timeout is None else connect_timeout
        conn = await self._connect(key, timeout)
        return await self._exchange(conn, request, deadlines, expect_id)

    async def _exchange(
        self, conn: _Connection, request: bytes, deadlines: Deadlines, expect_id: bytes | None
    ) -> Response:
        try:
            conn.send(request, deadlines, expect_id)
            while not conn.head_done:
                await conn.wait()
            return Response(conn, self)
        except BaseException:
            conn.close()
            raise

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
