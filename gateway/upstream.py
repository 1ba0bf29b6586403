"""A small HTTP/1.1 client for the gateway's hot path: forwarding to engine replicas.

What it supports, and nothing more:

- plain `http://` URLs only (https, the fallback API, stays on aiohttp);
- HTTP/1.1 requests with a body (POST), written synchronously: status line, headers and
  body in one `transport.write`, no extra event-loop iteration before the bytes leave;
- responses framed by `Content-Length`, by `Transfer-Encoding: chunked`, or (without
  either) by the server closing the connection; 1xx interim answers are skipped;
- a keep-alive pool per host:port: a connection goes back to the pool only when its
  response was read to the end, and is closed otherwise (so an engine sees a request
  whose client left end at once); one idle for `idle_timeout` seconds is closed rather
  than reused (the default, 4 s, is under uvicorn's 5 s keep-alive, which vLLM's
  server uses: the engine does not close a connection just as a request goes out on it);
- `User-Agent: kubellm-gateway/VERSION` and `Accept-Encoding: identity` unless the caller
  sends its own (the body is relayed as it comes, so it must not come compressed);
- a connect timeout, and a read timeout bounding each silence while a read waits
  (mid-stream included), checked by one timer per response rather than one per read
  (while the reader is busy elsewhere, a silence may last up to twice the timeout).

Failures raise `UpstreamError` (refused or reset connections, malformed or truncated
answers) or `ReadTimeout` (a `TimeoutError`); the connect timeout raises `TimeoutError`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from urllib.parse import urlsplit

from kubellm import __version__

_SKIPPED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
_MAX_HEAD = 64 * 1024  # status line and headers
_HIGH_WATER = 256 * 1024  # buffered body bytes before the socket stops being read
_DEFAULT_HEADERS = {"user-agent": f"kubellm-gateway/{__version__}", "accept-encoding": "identity"}


class UpstreamError(Exception):
    """The upstream failed: connection refused, reset or closed early, a bad answer."""


class ReadTimeout(UpstreamError, TimeoutError):
    """No byte arrived from the upstream for `read_timeout` seconds while one was awaited."""


class _Connection(asyncio.Protocol):
    """One TCP connection: a receive buffer, one waiting reader, the silence timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int]) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._last = 0.0  # when the last bytes arrived, or a wait began
        self._timer: asyncio.TimerHandle | None = None
        self._timeout = 0.0
        self.answered = False  # bytes arrived since the current request was sent
        self.idle_since = 0.0  # when it went back to the pool

    # -------------------------------------------------------------- protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.answered = True
        self._last = self.loop.time()
        if len(self.buffer) > _HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
            self._paused = True
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is not None and self.error is None:
            self.error = exc
        self._stop_timer()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -------------------------------------------------------------- reading

    def start_timer(self, timeout: float) -> None:
        """Arm the read timeout for one response (one timer, re-armed only when it fires)."""
        self._stop_timer()
        self._timeout = timeout
        self.answered = False
        self._last = self.loop.time()
        self._timer = self.loop.call_at(self._last + timeout, self._check_silence)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_silence(self) -> None:
        self._timer = None
        now, deadline = self.loop.time(), self._last + self._timeout
        if self._waiter is None:  # the reader is busy elsewhere: look again later
            self._timer = self.loop.call_at(now + self._timeout, self._check_silence)
        elif now < deadline:
            self._timer = self.loop.call_at(deadline, self._check_silence)
        else:
            waiter, self._waiter = self._waiter, None
            if not waiter.done():
                waiter.set_exception(ReadTimeout(f"no data for {self._timeout:g} s"))
            self.close()

    async def wait(self) -> None:
        """Wait until more bytes arrive (or the connection ends)."""
        if self.closed:
            if self.error is not None:
                raise UpstreamError(f"connection lost: {self.error!r}") from self.error
            raise UpstreamError("connection closed before the answer ended")
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._last = self.loop.time()
        waiter = self._waiter = self.loop.create_future()
        await waiter

    def take(self, size: int) -> bytes:
        """Up to `size` buffered bytes."""
        buffer = self.buffer
        if len(buffer) <= size:
            data = bytes(buffer)
            buffer.clear()
        else:
            data = bytes(buffer[:size])
            del buffer[:size]
        if self._paused and len(buffer) < _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def line(self) -> bytes:
        """The next CRLF-terminated line, without its CRLF."""
        while True:
            end = self.buffer.find(b"\r\n")
            if end >= 0:
                return self.take(end + 2)[:-2]
            if len(self.buffer) > _MAX_HEAD:
                raise UpstreamError("header line too long")
            await self.wait()

    def close(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    def detach(self) -> None:
        """The response was read to the end: stop its timer (the connection may be reused)."""
        self._stop_timer()


class Response:
    """An upstream answer: status and headers read; the body read with `readchunk`/`read`.

    `headers` has lower-case names. Call `close()` when done: it returns the connection
    to the pool if the body was read to the end, and closes it otherwise.
    """

    __slots__ = ("_chunked", "_conn", "_done", "_pool", "_remaining", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], conn: _Connection, pool: Pool) -> None:
        self.status = status
        self.headers = headers
        self._conn: _Connection | None = conn
        self._pool = pool
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._remaining = -1  # chunked: bytes left in the current chunk; -1: until close
        if self._chunked:
            self._remaining = 0
        elif length is not None:
            try:
                self._remaining = int(length)
            except ValueError:
                raise UpstreamError(f"bad content-length {length!r}") from None
            if self._remaining < 0:
                raise UpstreamError(f"bad content-length {length!r}")
        if status in (204, 304):
            self._remaining = 0
            self._chunked = False
        self._done = self._remaining == 0 and not self._chunked
        if self._done:  # no body
            conn.detach()

    @property
    def done(self) -> bool:
        """The body was read to its end."""
        return self._done

    async def readchunk(self) -> bytes:
        """The next piece of the body as it arrives (for a chunked answer, never more than
        one HTTP chunk's data, so each event is relayed on its own); b"" at the end."""
        if self._done:
            return b""
        conn = self._conn
        if conn is None:
            raise UpstreamError("response already closed")
        if self._chunked:
            if self._remaining == 0:
                size = await self._chunk_size(conn)
                if size == 0:
                    while await conn.line():  # trailers, up to the empty line
                        pass
                    self._finish()
                    return b""
                self._remaining = size
            while not conn.buffer:
                await conn.wait()
            data = conn.take(self._remaining)
            self._remaining -= len(data)
            if self._remaining == 0:
                while len(conn.buffer) < 2:
                    await conn.wait()
                if conn.take(2) != b"\r\n":
                    raise UpstreamError("bad chunk terminator")
            return data
        if self._remaining < 0:  # until the server closes
            while not conn.buffer:
                if conn.closed and conn.error is None:
                    self._done = True
                    conn.close()
                    return b""
                await conn.wait()
            return conn.take(len(conn.buffer))
        while not conn.buffer:
            await conn.wait()
        data = conn.take(self._remaining)
        self._remaining -= len(data)
        if self._remaining == 0:
            self._finish()
        return data

    @staticmethod
    async def _chunk_size(conn: _Connection) -> int:
        line = await conn.line()
        try:
            return int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise UpstreamError(f"bad chunk size line {line[:40]!r}") from None

    def _finish(self) -> None:
        self._done = True
        if self._conn is not None:
            self._conn.detach()

    async def read(self) -> bytes:
        """The whole (remaining) body."""
        parts = []
        while data := await self.readchunk():
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Pool the connection if the body was read to the end; close it otherwise."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        reusable = self.headers.get("connection", "").lower() != "close"
        if self._done and reusable and not conn.closed and not conn.buffer:
            self._pool.put(conn)
        else:
            conn.close()


class Pool:
    """Keep-alive connections per host:port, and the requests sent over them."""

    def __init__(
        self, connect_timeout: float, read_timeout: float, idle_timeout: float = 4.0
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle_timeout = idle_timeout
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}
        self._closed = False

    def idle(self, key: tuple[str, int]) -> int:
        """How many connections to `key` are pooled (some may have expired meanwhile)."""
        return len(self._idle.get(key, ()))

    def put(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        now = conn.idle_since = conn.loop.time()
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
            if conn.loop.time() - conn.idle_since > self.idle_timeout:
                conn.close()  # the newest has expired, so has every older one
                while idle:
                    idle.pop().close()
                return None
            return conn
        return None

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, key), key[0], key[1]
                )
        except OSError as error:  # refused, unreachable (TimeoutError passes through)
            if isinstance(error, TimeoutError):
                raise
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {error}") from error
        return conn

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send `body` to `url`; return once the status line and headers have arrived."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only http:// URLs are supported, not {url!r}")
        key = (parts.hostname, parts.port or 80)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        host = parts.netloc.rsplit("@", 1)[-1]
        lines = [f"POST {target} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"]
        given: set[str] = set()
        for name, value in headers.items():
            lower = name.lower()
            given.add(lower)
            if lower not in _SKIPPED_HEADERS:
                lines.append(f"{name}: {value}\r\n")
        for name, value in _DEFAULT_HEADERS.items():
            if name not in given:
                lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        request = "".join(lines).encode("latin-1") + body

        conn = self._pooled(key)
        if conn is not None:
            try:
                return await self._exchange(conn, request)
            except UpstreamError as error:
                # a kept-alive connection the server had just closed: once more, afresh
                if isinstance(error, ReadTimeout) or conn.answered:
                    raise
        return await self._exchange(await self._connect(key), request)

    async def _exchange(self, conn: _Connection, request: bytes) -> Response:
        try:
            assert conn.transport is not None
            conn.transport.write(request)
            conn.start_timer(self.read_timeout)
            while True:
                status, headers = await _read_head(conn)
                if not 100 <= status < 200:
                    return Response(status, headers, conn, self)
        except BaseException:
            conn.close()
            raise

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


async def _read_head(conn: _Connection) -> tuple[int, dict[str, str]]:
    status_line = await conn.line()
    try:
        version, code = status_line.split(b" ", 2)[:2]
        status = int(code)
    except ValueError:
        raise UpstreamError(f"bad status line {status_line[:60]!r}") from None
    if not version.startswith(b"HTTP/1."):
        raise UpstreamError(f"bad status line {status_line[:60]!r}")
    headers: dict[str, str] = {}
    while line := await conn.line():
        name, sep, value = line.partition(b":")
        if not sep:
            raise UpstreamError(f"bad header line {line[:60]!r}")
        key = name.strip().lower().decode("latin-1")
        text = value.strip().decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return status, headers
