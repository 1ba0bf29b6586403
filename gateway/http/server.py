"""Serving the gateway: uvicorn (llhttp framing) with bounds on what clients may hold.

uvicorn frames requests with llhttp and caps nothing a slow or hostile client can
hold: a connection that never sends its headers, or trickles them, stays open for
ever, and enough of them exhaust the process's file descriptors. `GuardedProtocol`
adds, per connection:

- a **header timeout**: from the connection's start, or from the first byte of the
  next request on a kept-alive connection, to the end of its headers;
- a **header size cap**: a request line and headers over `max_head_bytes` get a 431
  and the connection is closed (llhttp itself sets no bound);
- a **connection cap**: a connection over it is answered a 503 in OpenAI's envelope
  and closed at once (counted in `kubellm_gateway_connections_refused_total`,
  logged at most every 10 s), so the descriptors left serve the clients already in.

The body read timeout is the app's (`GatewaySettings.body_timeout`); uvicorn's own
keep-alive timeout closes a connection idle between requests.

A whole answer (its length known) can leave in one send (`WholeCycle.send_whole`, in
each request's `scope["extensions"]`): uvicorn writes an answer's head and its body apart,
two sends where one does (on loopback each send also runs the receiver's TCP path).

It also tells the app when a client's connection is lost (`ConnectionLost`, in each
request's `scope["extensions"]`): a request in flight learns that its client left from a
callback, without a task per request waiting on ASGI `receive` for the
`http.disconnect` (`relay.DisconnectWatch`), which uvicorn sends on the same event.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from kubellm.gateway.http.settings import ClientLimits
from kubellm.gateway.protocol.errors import headers_too_large, server_busy
from uvicorn.config import LOG_LEVELS
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from kubellm.event_loop import loop_factory

log = logging.getLogger("kubellm.gateway")


# The scope extension that carries the connection's `ConnectionLost` (ASGI lets a server
# add its own keys to `scope["extensions"]`); absent under other servers.
CONNECTION_LOST = "kubellm.connection_lost"
# The scope extension that says whether the request's whole body is already read (a
# zero-argument callable): then the app's first `receive` returns at once, so its body
# deadline needs no timer. Absent under other servers.
BODY_BUFFERED = "kubellm.body_buffered"
# The scope extension that sends a whole answer in one write: `send_whole(status, headers,
# body) -> bool` (`WholeCycle.send_whole`); False: not sent, use ASGI `send`. Absent under
# other servers.
SEND_WHOLE = "kubellm.send_whole"


class ConnectionLost:
    """One client connection's end, for the requests served on it: `watch(callback)` runs
    `callback` once when the connection is lost (at once if it already was), unless
    `unwatch(callback)` came first."""

    __slots__ = ("_callbacks", "lost")

    def __init__(self) -> None:
        self._callbacks: set[Callable[[], None]] = set()
        self.lost = False

    def watch(self, callback: Callable[[], None]) -> None:
        if self.lost:
            callback()
        else:
            self._callbacks.add(callback)

    def unwatch(self, callback: Callable[[], None]) -> None:
        self._callbacks.discard(callback)

    def fire(self) -> None:
        """The connection is lost: run each watcher's callback (once)."""
        self.lost = True
        callbacks, self._callbacks = self._callbacks, set()
        for callback in callbacks:
            callback()


class WholeCycle(RequestResponseCycle):
    """uvicorn's request cycle with `send_whole`: an answer whose body is all at hand
    leaves in one write (head and body in one `writev`), where ASGI's `http.response.start`
    and `http.response.body` make uvicorn write twice."""

    def send_whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """Send the answer as uvicorn's `send` would send `http.response.start` with
        `headers` (a `content-length` equal to the body's among them) and then `body`, the
        same bytes; True when sent. False, nothing written, where its `send` has more to
        do: a response begun, the client gone or not reading, a HEAD request, a header
        it would refuse or that changes the framing."""
        if (
            self.response_started
            or self.disconnected
            or self.flow.write_paused
            or self.scope["method"] == "HEAD"
        ):
            return False
        content = [STATUS_LINE[status]]
        length = False
        for pair in (*self.default_headers, *headers):
            line = _LINES.get(pair)
            if line is None:
                name, value = pair[0].lower(), pair[1]
                if name == b"content-length":
                    if length or value != str(len(body)).encode():
                        return False
                    length = True
                    line = b"content-length: " + value + b"\r\n"
                else:
                    line = _line(pair, name, value)
                    if line is None:
                        return False
            content.append(line)
        if not length:
            return False
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        content.append(b"\r\n")
        if self.access_log:
            scope = self.scope
            self.access_logger.info(
                '%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                get_path_with_query_string(scope), scope["http_version"], status,
            )  # fmt: skip
        self.response_started = self.response_complete = True
        self.waiting_for_100_continue = False
        self.chunked_encoding, self.expected_content_length = False, 0
        self.transport.writelines((b"".join(content), body))
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()
        return True


# Header lines as uvicorn's `send` writes them (lower-case name), for the pairs that pass
# its checks (a token for a name, no control byte in the value) and leave the framing
# alone. The same few go out on every answer (the route, the content type, the server's
# date each second): checked and encoded once, not with two regex searches and four
# pieces per line per answer (~3% of a request's work). Emptied when full, so a flood of
# distinct values costs no memory.
_LINES: dict[tuple[bytes, bytes], bytes] = {}
_LINES_MAX = 1024


def _line(pair: tuple[bytes, bytes], name: bytes, value: bytes) -> bytes | None:
    """`name: value` as uvicorn sends it (`name` lower-cased), remembered; None where its
    `send` would refuse the pair, or where the pair sets the framing (`transfer-encoding`,
    `connection`): `send_whole` leaves those to `send`."""
    if name == b"transfer-encoding" or name == b"connection":
        return None
    if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
        return None
    if len(_LINES) >= _LINES_MAX:
        _LINES.clear()
    line = _LINES[pair] = b"%s: %s\r\n" % (name, value)
    return line


def default_max_connections() -> int:
    """Half the process's descriptor limit (the rest: replicas, the fallback, scraping),
    at most 16,384."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 16_384
    return max(64, min(16_384, soft // 2))


def guarded_protocol(limits: ClientLimits, on_refused: Callable[[], None]) -> type[Any]:
    """uvicorn's httptools protocol with the header timeout and the connection cap."""
    cap = limits.max_connections or default_max_connections()
    header_timeout = limits.header_timeout
    max_head = limits.max_head_bytes
    last_log = [0.0]
    refused_since_log = [0]

    def refused() -> None:
        on_refused()
        refused_since_log[0] += 1
        now = time.monotonic()
        if now - last_log[0] >= 10.0:
            log.warning(
                "connection cap of %d reached: %d connections refused with 503",
                cap,
                refused_since_log[0],
            )
            last_log[0] = now
            refused_since_log[0] = 0

    class GuardedProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _refused = False
        _in_head = True  # reading a request's line and headers
        _head_started = False  # a request's first byte came, its headers' end not yet
        _head_bytes = 0
        _lost: ConnectionLost
        _idle_timer: asyncio.TimerHandle | None = None  # the keep-alive check
        _idle_from = 0.0  # when the last answer ended, no bytes since (0.0: not idle)

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            if len(self.connections) >= cap:
                self._refused = True
                transport.write(server_busy())  # type: ignore[attr-defined]
                transport.close()
                refused()
                return
            super().connection_made(transport)  # type: ignore[arg-type]
            self._lost = ConnectionLost()
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > max_head:
                    self._refused = True
                    self.connections.discard(self)
                    self._cancel_header_timer()
                    self.transport.write(headers_too_large())
                    self.transport.close()
                    return
            super().data_received(data)
            # A request's head usually arrives whole, in one read: the header timer is
            # armed only for one still incomplete after it (from this read on, a moment
            # after its first byte), not armed and cancelled for every request.
            if self._head_started and not self._refused:
                self._arm_header_timer()

        def on_response_complete(self) -> None:
            # uvicorn's, but for its keep-alive timeout: it arms a timer at each answer's
            # end and cancels it at the next request's first bytes (~0.5% of a request's
            # work). Here one timer per connection checks, when it fires, how long the
            # connection has been idle, and comes back for the rest (`_idle_check`).
            self._in_head, self._head_bytes = True, 0
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            self._unset_keepalive_if_required()
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:
                self._idle_from = self.loop.time()
                if self._idle_timer is None:
                    self._idle_timer = self.loop.call_later(
                        self.timeout_keep_alive, self._idle_check
                    )

        def _unset_keepalive_if_required(self) -> None:
            self._idle_from = 0.0  # bytes came (uvicorn calls it then): not idle
            super()._unset_keepalive_if_required()

        def _idle_check(self) -> None:
            """Close the connection once idle for the keep-alive timeout since its last
            answer; busy or idle for less, look again when that much could have passed."""
            self._idle_timer = None
            if self._idle_from == 0.0 or self.transport.is_closing():
                return  # a request in progress: its answer's end arms the check again
            left = self._idle_from + self.timeout_keep_alive - self.loop.time()
            if left > 0:
                self._idle_timer = self.loop.call_later(left, self._idle_check)
            else:
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_started = True
            self.scope["extensions"] = {CONNECTION_LOST: self._lost}

        def on_headers_complete(self) -> None:
            self._in_head = self._head_started = False
            self._cancel_header_timer()
            super().on_headers_complete()
            cycle = self.cycle  # its `receive` waits only while more of the body is due
            extensions = self.scope["extensions"]
            extensions[BODY_BUFFERED] = lambda: not cycle.more_body
            if type(cycle) is RequestResponseCycle:
                # uvicorn builds its own cycle; the subclass adds a method and no state, and
                # the class is set before the app's task first runs.
                cycle.__class__ = WholeCycle
                extensions[SEND_WHOLE] = cycle.send_whole

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._cancel_header_timer()
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            super().connection_lost(exc)
            self._lost.fire()

        def eof_received(self) -> None:
            if not self._refused:
                super().eof_received()

    return GuardedProtocol


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop the gateway serves on (kubellm.event_loop): KUBELLM_GATEWAY_LOOP=asyncio
    forces asyncio's."""
    return loop_factory("KUBELLM_GATEWAY_LOOP")


def config(
    app: Any,
    limits: ClientLimits,
    on_refused: Callable[[], None],
    **kwargs: Any,
) -> uvicorn.Config:
    """A uvicorn configuration serving `app` with `limits`. Its access log is off where
    `log_level` drops it anyway (above info): uvicorn would still format each request's
    client address and path for a record its level then discards.

    Without an access log, an app that says which of its requests read the client's
    address or scheme (`proxy_headers_around(trusted_hosts)`, the gateway's: all but the
    completion routes, which read neither) gets uvicorn's proxy-headers middleware around
    those only, not around every request."""
    level = kwargs.get("log_level")
    if isinstance(level, str):
        level = LOG_LEVELS[level.lower()]
    if level is not None and level > logging.INFO:
        kwargs.setdefault("access_log", False)
    configured = uvicorn.Config(
        app,
        http=guarded_protocol(limits, on_refused),
        timeout_keep_alive=int(max(1, limits.keep_alive_timeout)),
        **kwargs,
    )
    around = getattr(app, "proxy_headers_around", None)
    if around is not None and configured.proxy_headers and not configured.access_log:
        around(configured.forwarded_allow_ips)
        configured.proxy_headers = False
    return configured


async def serve(servers: list[tuple[uvicorn.Server, list[socket.socket] | None]]) -> None:
    """Run several uvicorn servers (the API and its metrics port) until one stops."""
    tasks = [asyncio.create_task(s.serve(sockets=socks)) for s, socks in servers]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for server, _ in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
