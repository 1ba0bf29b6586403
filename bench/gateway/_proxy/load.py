"""The load generator of bench/gateway/proxy.py: raw asyncio HTTP/1.1 keep-alive
connections, closed loop (one request at a time per connection) or Poisson arrivals, and
the figures of one measured window (percentiles as `kubellm.bench.stats` defines them)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubellm.bench.stats import percentile


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request in flight at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.done: asyncio.Future[dict[str, Any]] | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection closed"))
        if not self.lost.done():
            self.lost.set_result(None)

    def request(self, data: bytes) -> asyncio.Future[dict[str, Any]]:
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.status = 0
        self.head_done = False
        self.length: int | None = None  # content-length body; None: chunked
        self.events: list[float] = []
        self.sent = time.perf_counter()
        self.transport.write(data)
        return self.done

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.buf += data
        buf = self.buf
        if not self.head_done:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            self.status = int(head[9:12])
            i = head.find(b"content-length:")
            if i >= 0:
                j = head.find(b"\r\n", i)
                self.length = int(head[i + 15 : j if j > 0 else None])
            else:
                self.length = None
            del buf[: end + 4]
            self.head_done = True
        if self.length is not None:
            if len(buf) < self.length:
                return
            del buf[: self.length]
            self.events.append(now)
            self._finish(now)
            return
        while True:  # chunked
            j = buf.find(b"\r\n")
            if j < 0:
                return
            size = int(buf[:j].split(b";")[0], 16)
            if len(buf) < j + 2 + size + 2:
                return
            if size == 0:
                del buf[: j + 4]
                self._finish(now)
                return
            events = buf.count(b"data:", j + 2, j + 2 + size)
            self.events.extend([now] * events)
            del buf[: j + 2 + size + 2]

    def _finish(self, now: float) -> None:
        assert self.done is not None
        if not self.done.done():
            self.done.set_result(
                {"status": self.status, "sent": self.sent, "events": self.events, "end": now}
            )


def request_bytes(port: int, body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"content-type: application/json\r\naccept: */*\r\ncontent-length: %d\r\n\r\n%s"
        % (port, len(raw), raw)
    )


def bodies(port: int, count: int, stream: bool, chunks: int, itl_ms: float) -> list[bytes]:
    """Distinct prompts (a number up front), so prefix routing sees new prefixes."""
    out = []
    for i in range(count):
        body: dict[str, Any] = {
            "model": "m",
            "messages": [{"role": "user", "content": f"{i} " + "hello " * 50}],
            "stream": stream,
        }
        if stream:
            body["bench_chunks"] = chunks
            body["bench_itl_ms"] = itl_ms
        out.append(request_bytes(port, body))
    return out


async def drive(
    port: int,
    requests: list[bytes],
    concurrency: int,
    seconds: float,
    stagger: float = 0.0,
    rate: float | None = None,
    rng: random.Random | None = None,
    on_start: Callable[[], None] | None = None,
    on_stop: Callable[[], None] | None = None,
) -> dict:
    """Load for `seconds` after one warm-up second; the requests answered meanwhile.

    Closed loop (`rate` None): one request after another on each of `concurrency`
    connections; `stagger`: each connection starts at a random moment in its first
    `stagger` seconds. Open loop (`rate`): Poisson arrivals at `rate` per second, each
    on an idle keep-alive connection (`concurrency` opened up front, more as needed).
    `on_start` / `on_stop` run as the measured window opens and closes (CPU readings).
    """
    loop = asyncio.get_running_loop()
    rng = rng or random.Random(1)
    conns = []
    for _ in range(concurrency):
        _, proto = await loop.create_connection(Connection, "127.0.0.1", port)
        conns.append(proto)
    results: list[dict[str, Any]] = []
    errors = 0
    state = {"record": False, "stop": False, "next": 0}

    async def exchange(conn: Connection) -> bool:
        nonlocal errors
        data = requests[state["next"] % len(requests)]
        state["next"] += 1
        try:
            r = await conn.request(data)
        except (ConnectionError, RuntimeError):  # closed by the proxy (uvloop: RuntimeError)
            errors += 1
            return False
        if state["record"]:
            if r["status"] != 200:
                errors += 1
            results.append(r)
        return True

    async def worker(conn: Connection) -> None:
        if stagger:
            await asyncio.sleep(rng.uniform(0, stagger))
        while not state["stop"] and await exchange(conn):
            pass

    async def one(conn: Connection) -> None:
        if await exchange(conn):
            conns.append(conn)

    async def arrivals(rate: float) -> None:
        pending: set[asyncio.Future[None]] = set()
        due = loop.time()
        while not state["stop"]:
            due += rng.expovariate(rate)
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            if conns:
                conn = conns.pop()
            else:
                _, conn = await loop.create_connection(Connection, "127.0.0.1", port)
            task = asyncio.ensure_future(one(conn))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending, timeout=30)

    if rate is None:
        tasks = [asyncio.ensure_future(worker(c)) for c in conns]
    else:
        tasks = [asyncio.ensure_future(arrivals(rate))]
    await asyncio.sleep(1.0)  # warm-up
    state["record"] = True
    cpu0 = cpu_self()
    started = time.perf_counter()
    if on_start is not None:
        on_start()
    await asyncio.sleep(seconds)
    state["record"] = False
    wall = time.perf_counter() - started
    if on_stop is not None:
        on_stop()
    cpu = cpu_self() - cpu0
    state["stop"] = True
    await asyncio.gather(*tasks)
    for c in conns:  # closed loop: all; open loop: the idle ones (the rest closed below)
        assert c.transport is not None
        c.transport.close()
    return summarize(results, wall, errors, cpu)


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_of(pid: int) -> float:
    """A process's user + system CPU seconds so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    """The `q` quantile (0-1) by `kubellm.bench.stats.percentile`; NaN for no values."""
    value = percentile(values, 100 * q)
    return float("nan") if value is None else value


def max_within(times: list[float], window: float) -> int:
    """The most of `times` that fall within any `window` seconds."""
    times = sorted(times)
    most, first = 0, 0
    for last, t in enumerate(times):
        while t - times[first] > window:
            first += 1
        most = max(most, last - first + 1)
    return most


def summarize(results: list[dict[str, Any]], wall: float, errors: int, cpu: float) -> dict:
    e2e = [1000 * (r["end"] - r["sent"]) for r in results]
    ttft = [1000 * (r["events"][0] - r["sent"]) for r in results if r["events"]]
    gaps = [
        1000 * (b - a) for r in results for a, b in zip(r["events"], r["events"][1:], strict=False)
    ]
    return {
        "requests": len(results),
        "in_flight": sum(r["end"] - r["sent"] for r in results) / wall,  # Little's law
        "burst": max_within([r["sent"] for r in results], 0.001),
        "errors": errors,
        "rps": len(results) / wall,
        "p50_ms": pct(e2e, 0.5),
        "p99_ms": pct(e2e, 0.99),
        "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p99_ms": pct(ttft, 0.99),
        "gap_p50_ms": pct(gaps, 0.5),
        "gap_p99_ms": pct(gaps, 0.99),
        "loadgen_cpu_ms_per_request": 1000 * cpu / max(1, len(results)),
    }


# ---------------------------------------------------------------- processes


def run_loop(coro: Any) -> Any:
    """The load generator's event loop: uvloop where installed (less CPU per request)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
