"""Replicas that answer the gateway's scrapes with gigabytes: the gateway stays small.

The gateway scrapes each replica's `/metrics` (load) and, for LoRA models, `/v1/models`
(registered adapters) every interval. A replica answering either with 1 GiB (streamed in
chunks, or with the length declared up front) must cost the gateway no more than the
bounded reader's limit (kubellm.bounded, 16 MiB), and the replica counts as down."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field

import httpx
import pytest

from tests.fixtures.engines import wait_until
from tests.gateway.faults.peers import METRICS, completion, response

GIB = 1 << 30
CHUNK = b"#" * 65536 + b"\n"  # a comment line: valid Prometheus text, never ending


@dataclass
class FloodingEngine:
    """An engine whose `flood` path (`/metrics` or `/v1/models`) answers with 1 GiB, written
    as fast as the gateway reads it (at most 1 GiB per request, then the connection closes);
    other paths answer normally. `chunked`: no length declared."""

    flood: str
    chunked: bool
    floods: int = 0
    sent: int = 0
    stopping: threading.Event = field(default_factory=threading.Event)

    def start(self) -> FloodingEngine:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def main() -> None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
            ready.set()
            await self.server.serve_forever()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            with contextlib.suppress(asyncio.CancelledError):
                self.loop.run_until_complete(main())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(5), "flooding engine did not start"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while not self.stopping.is_set():
                head = await reader.readuntil(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0].decode()
                length = 0
                for header in head.split(b"\r\n")[1:]:
                    if header.lower().startswith(b"content-length:"):
                        length = int(header.split(b":", 1)[1])
                await reader.readexactly(length)
                path = line.split(" ")[1]
                if path == self.flood:
                    self.floods += 1
                    await self._flood(writer)
                    return
                if path == "/metrics":
                    writer.write(response(METRICS, content_type="text/plain"))
                elif path == "/v1/models":
                    writer.write(response(b'{"object": "list", "data": []}'))
                else:
                    writer.write(completion("ok"))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _flood(self, writer: asyncio.StreamWriter) -> None:
        kind = "text/plain" if self.flood == "/metrics" else "application/json"
        if self.chunked:
            writer.write(
                f"HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\n"
                "transfer-encoding: chunked\r\n\r\n".encode()
            )
            frame = b"%x\r\n" % len(CHUNK) + CHUNK + b"\r\n"
        else:
            writer.write(
                f"HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {GIB}\r\n\r\n".encode()
            )
            frame = CHUNK
        written = 0
        while written < GIB and not self.stopping.is_set():  # bounded: 1 GiB a request
            writer.write(frame)
            written += len(frame)
            self.sent += len(frame)
            await writer.drain()

    def stop(self) -> None:
        self.stopping.set()

        def shutdown() -> None:
            self.server.close()
            for task in asyncio.all_tasks(self.loop):
                task.cancel()

        self.loop.call_soon_threadsafe(shutdown)
        self.thread.join(5)


@pytest.fixture
def flooding():
    started: list[FloodingEngine] = []

    def start(flood: str, chunked: bool) -> FloodingEngine:
        engine = FloodingEngine(flood, chunked).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "declared"])
@pytest.mark.parametrize("flood", ["/metrics", "/v1/models"])
def test_a_gigabyte_scrape_answer_keeps_the_gateway_small(
    flooding, gateway_process, flood, chunked
):
    engine = flooding(flood, chunked)
    config = {"name": "m", "endpoints": [engine.url]}
    if flood == "/v1/models":
        config["adapters"] = {"sql": "/models/adapters/sql"}  # a LoRA model: /v1/models read
    gw = gateway_process([config])
    before = gw.peak_mib
    # Three floods started (a new scrape begins only once the last ended: each was cut off).
    wait_until(lambda: engine.floods >= 3, 60, f"three scrapes of {flood}")
    grown = gw.peak_mib - before
    sent = engine.sent >> 20
    assert grown < 40, f"the gateway's peak memory grew by {grown:.0f} MiB ({sent} MiB sent)"
    assert httpx.get(f"{gw.url}/health", timeout=5).status_code == 200


def test_only_the_read_families_are_parsed_and_their_lines_are_bounded() -> None:
    from kubellm.gateway.routing.replicas.load import MAX_SAMPLE_LINES, relevant_lines

    other = "".join(f'vllm:other{{x="{i}"}} 1\n' for i in range(50_000))
    text = relevant_lines(METRICS.decode() + other)
    assert text.splitlines() == METRICS.decode().splitlines()
    many = "".join(f'vllm:num_requests_waiting{{x="{i}"}} 1\n' for i in range(MAX_SAMPLE_LINES + 1))
    with pytest.raises(ValueError, match="more than 10000 samples"):
        relevant_lines(many)
