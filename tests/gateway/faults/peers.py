"""Misbehaving peers on loopback, and a gateway in its own process to measure.

`RawEngine` is an engine that speaks raw bytes: each request on a connection is
handed to `respond(request) -> bytes | None`, and whatever it returns is written as
it is (a valid answer, an answer with an extra one behind it, a giant header block,
a bad chunk size, nothing at all). A `Close` answer is written and the connection
closed. `None` is silence: the request is read and never answered (a frozen engine),
while `GET /metrics` still answers with idle vLLM gauges unless `metrics` is off.

`GatewayProcess` runs `kubellm gateway --static FILE` as a subprocess on a free
port, so a test can read its peak memory (`VmHWM`) and check it after an attack.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.fixtures.engines import free_port, wait_until

METRICS = (
    b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
    b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
    b"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0\n"
)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def echo_id(request: Request) -> str:
    """The `x-request-id` header line an engine that echoes ids (vLLM, the simulator) sends."""
    given = request.headers.get("x-request-id")
    return f"x-request-id: {given}\r\n" if given else ""


def response(
    body: bytes, status: str = "200 OK", content_type: str = "application/json", extra: str = ""
) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n{extra}"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


def completion(text: str, stream: bool = False, extra: str = "") -> bytes:
    """A valid answer carrying `text`: JSON, or an SSE stream in HTTP chunks."""
    if not stream:
        body = {
            "id": "c", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }  # fmt: skip
        return response(json.dumps(body).encode(), extra=extra)
    events = [
        b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    return chunked(events, extra=extra)


def chunked(
    pieces: list[bytes], size_line: Callable[[bytes], bytes] | None = None, extra: str = ""
) -> bytes:
    """An SSE answer framed in HTTP chunks; `size_line` may forge each chunk's size line."""
    head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    out = [(head + extra + "\r\n").encode()]
    for piece in pieces:
        size = size_line(piece) if size_line else b"%x" % len(piece)
        out.append(size + b"\r\n" + piece + b"\r\n")
    out.append(b"0\r\n\r\n")
    return b"".join(out)


class Close(bytes):
    """An answer after which the engine closes the connection."""


@dataclass
class Later:
    """An answer written in two parts, `delay` seconds apart (an engine that writes late)."""

    now: bytes
    delay: float
    later: bytes


@dataclass
class RawEngine:
    respond: Callable[[Request], bytes | Later | None]
    metrics: bool = True
    metrics_body: bytes = METRICS  # what `GET /metrics` answers (a hostile replica's figures)
    requests: list[Request] = field(default_factory=list)
    connections: int = 0
    scrapes: int = 0

    def start(self) -> RawEngine:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def main() -> None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            await self.server.serve_forever()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            with contextlib.suppress(asyncio.CancelledError):
                self.loop.run_until_complete(main())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(5), "raw engine did not start"
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                if request.method == "GET" and request.path == "/metrics":
                    if not self.metrics:
                        return
                    self.scrapes += 1
                    writer.write(response(self.metrics_body, content_type="text/plain"))
                else:
                    self.requests.append(request)
                    answer = self.respond(request)
                    if answer is None:
                        await reader.read()  # never answers; ends when the peer closes
                        return
                    if isinstance(answer, Later):
                        writer.write(answer.now)
                        await writer.drain()
                        await asyncio.sleep(answer.delay)  # the fault: bytes written late
                        answer = answer.later
                    writer.write(answer)
                    if isinstance(answer, Close):
                        await writer.drain()
                        return
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        def shutdown() -> None:
            self.server.close()
            for task in asyncio.all_tasks(self.loop):
                task.cancel()

        self.loop.call_soon_threadsafe(shutdown)
        self.thread.join(5)


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    """A test double's reading of one request: line, headers, Content-Length body."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Request(method, path, headers, body)


def vm_peak_mib(pid: int) -> float:
    """A process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


class GatewayProcess:
    """`kubellm gateway --static` in a subprocess on 127.0.0.1, with `flags`."""

    def __init__(self, directory: Path, models: list[dict[str, Any]], *flags: str) -> None:
        self.config = directory / "gateway.yaml"
        self.config.write_text(yaml.safe_dump({"models": models}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = directory / "gateway.log"
        command = [sys.executable, "-m", "kubellm.gateway.cli", "--static", str(self.config),
                   "--port", str(self.port), "--scrape-interval", "0.2", *flags]  # fmt: skip
        self.process = subprocess.Popen(
            command,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        # a deadline for a hang: a process start took over 30 s on the loaded CI machine
        wait_until(self._healthy, 120, "the gateway process to answer /health")

    def _healthy(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def peak_mib(self) -> float:
        return vm_peak_mib(self.process.pid)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
