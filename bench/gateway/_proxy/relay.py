"""A bare TCP relay (--relay-floor): bytes copied between each client connection and its
own backend connection, no HTTP parsing. What it adds is the floor of the topology (one
more process and two more loopback hops) under any proxy, Python or not.

    python bench/gateway/_proxy/relay.py BACKEND_PORT LISTEN_PORT
"""

from __future__ import annotations

import asyncio
import signal
import sys


class Up(asyncio.Protocol):
    def __init__(self, down: asyncio.Transport) -> None:
        self.down = down

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.down.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.down.close()


class Down(asyncio.Protocol):
    def __init__(self, upstream: int) -> None:
        self.upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]
        self.up: Up | None = None
        self.early: list[bytes] = []
        self.connecting = asyncio.ensure_future(self.connect())

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, self.up = await loop.create_connection(lambda: Up(self.t), "127.0.0.1", self.upstream)
        for data in self.early:
            self.up.t.write(data)

    def data_received(self, data: bytes) -> None:
        if self.up is None:
            self.early.append(data)
        else:
            self.up.t.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None:
            self.up.t.close()


async def main(upstream: int, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    server = await loop.create_server(lambda: Down(upstream), "127.0.0.1", port, backlog=1024)
    await stop.wait()
    server.close()


if __name__ == "__main__":
    upstream, port = int(sys.argv[1]), int(sys.argv[2])
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(upstream, port))
    else:
        uvloop.run(main(upstream, port))
