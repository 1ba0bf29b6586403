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
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kubellm.event_loop import loop_factory

log = logging.getLogger("kubellm.gateway")


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
        _head_bytes = 0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            if len(self.connections) >= cap:
                self._refused = True
                transport.write(server_busy())  # type: ignore[attr-defined]
                transport.close()
                refused()
                return
            super().connection_made(transport)  # type: ignore[arg-type]
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

        def on_response_complete(self) -> None:
            self._in_head, self._head_bytes = True, 0
            super().on_response_complete()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._cancel_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._cancel_header_timer()
            super().connection_lost(exc)

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
    """A uvicorn configuration serving `app` with `limits`."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(limits, on_refused),
        timeout_keep_alive=int(max(1, limits.keep_alive_timeout)),
        **kwargs,
    )


async def serve(servers: list[tuple[uvicorn.Server, list[socket.socket] | None]]) -> None:
    """Run several uvicorn servers (the API and its metrics port) until one stops."""
    tasks = [asyncio.create_task(s.serve(sockets=socks)) for s, socks in servers]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for server, _ in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
