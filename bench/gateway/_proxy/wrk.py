"""`--wrk`: the issue's proxy-cost measurement (issue 38), with `wrk` as the load generator.

Each path runs pinned to the proxy core (`--gateway-core`; a two-process path has both
there), the backend and `wrk` (one thread) on the load core (`taskset`). Non-streamed chat
completions, each with a distinct ~300-byte prompt (a counter up front, as the socket mode's),
`--concurrency` keep-alive connections, `--seconds` per round after a 1 s warm-up;
`--rounds` rounds per path, interleaved (round 1 of every path, then round 2, ...), medians
reported. CPU per request: the path's processes' user + system time over the round (/proc)
divided by the requests wrk counted. Rows: the gateway with the shipped defaults first,
then the gateway with every non-streamed request assembled (`--assemble-non-streamed`, the
previous default), the gateway over `--replicas` replicas of the model (default 4; the
same backend process on as many ports: a real pool, where every request is scored against
each replica, while the rows above and Envoy's have one endpoint), `gateway@landed` with
`--baseline-python PY` (another checkout's gateway, its rounds interleaved with these, so
one run compares the two under the same load), Envoy direct, Envoy + `kubellm epp`,
vllm-router where installed.
The targets (issue 38): the gateway >= 0.25x Envoy's req/s at <= 4x its CPU per request;
Envoy + picker >= 0.5x the gateway's req/s.

Needs wrk (Debian/Ubuntu: `apt-get install wrk`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
from typing import Any

from bench import _fleet
from bench.gateway._proxy import load, paths

# wrk's Lua: each request a distinct prompt (a per-thread counter up front)
SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local n = 0
request = function()
  n = n + 1
  local body = '{"model":"m","messages":[{"role":"user","content":"' .. n .. ' '
    .. string.rep("hello ", 50) .. '"}]}'
  return wrk.format(nil, "/v1/chat/completions", nil, body)
end
"""
REQUESTS = re.compile(r"^\s*(\d+) requests in", re.M)
ERRORS = re.compile(
    r"Non-2xx or 3xx responses: (\d+)"
    r"|Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)"
)
GATEWAY_ROWS = (("gateway", ()), ("gateway --assemble-non-streamed", ("--assemble-non-streamed",)))


def wrk_mode(args: argparse.Namespace) -> dict[str, Any]:
    """The rows (medians of `args.rounds`), printed; the figures for the JSON file."""
    binary = shutil.which("wrk")
    if binary is None:
        raise SystemExit("--wrk needs wrk on PATH (Debian/Ubuntu: apt-get install -y wrk)")
    core, load_core = args.gateway_core, args.load_core
    with _fleet.Processes() as procs:
        script = procs.dir / "requests.lua"
        script.write_text(SCRIPT)
        ports = paths.backends(procs, load_core, max(1, args.replicas))
        backend_port = ports[0]
        started: list[tuple[str, paths.Started]] = []
        for name, flags in GATEWAY_ROWS:
            started.append((name, paths.gateway(procs, backend_port, core, flags=flags)))
        if args.baseline_python:  # another checkout's gateway, its rounds interleaved
            landed = paths.gateway(procs, backend_port, core, python=args.baseline_python)
            started.append(("gateway@landed", landed))
        if args.replicas > 1:  # the realistic pool: the pass and the profile choose
            name = f"gateway, {args.replicas} replicas"
            started.append((name, paths.gateway(procs, ports, core)))
        for name in filter(None, args.peers.split(",")):  # default: envoy, vllm-router, envoy+epp
            if name == "envoy+epp":
                started.append((name, paths.envoy_epp(procs, backend_port, core)))
            elif name == "envoy+epp-floor":  # the picker's transport, a fixed route
                started.append((name, paths.envoy_epp(procs, backend_port, core, floor=True)))
            elif (one := paths.peer(procs, name, backend_port, core)) is not None:
                started.append((name, one))
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _ in started}
        for _ in range(args.rounds):
            for name, (port, pids) in started:
                rounds[name].append(one_round(binary, load_core, script, port, pids, args))
    rows = []
    for name, runs in rounds.items():
        rps = statistics.median(r["rps"] for r in runs)
        cpu = statistics.median(r["cpu_ms"] for r in runs)
        errors = sum(r["errors"] for r in runs)
        rows.append({"path": name, "rps": rps, "cpu_ms_per_request": cpu, "errors": errors,
                     "rounds": runs})  # fmt: skip
    report(rows, args)
    return {"rows": rows, "loadavg": os.getloadavg()}


def one_round(
    binary: str,
    load_core: int,
    script: os.PathLike[str],
    port: int,
    pids: dict[str, int],
    args: argparse.Namespace,
) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    command = ["taskset", "-c", str(load_core), binary, "-t1", f"-c{args.concurrency}",
               "--timeout", "10s", "-s", str(script), url]  # fmt: skip
    subprocess.run([*command, "-d1s"], check=True, capture_output=True, timeout=60)  # warm-up
    before = {n: load.cpu_of(p) for n, p in pids.items()}
    out = subprocess.run(
        [*command, f"-d{args.seconds:g}s"],
        check=True, capture_output=True, text=True, timeout=args.seconds + 60,
    ).stdout  # fmt: skip
    used = sum(load.cpu_of(p) - before[n] for n, p in pids.items())
    found = REQUESTS.search(out)
    if found is None:
        raise RuntimeError(f"wrk printed no request count:\n{out}")
    count = max(1, int(found.group(1)))
    errors = sum(int(g) for m in ERRORS.finditer(out) for g in m.groups() if g)
    return {"rps": count / args.seconds, "cpu_ms": 1000 * used / count, "errors": errors}


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    la = os.getloadavg()
    print(
        f"wrk: 1 thread, {args.concurrency} connections, non-streamed; proxy on core "
        f"{args.gateway_core}, backend + wrk on core {args.load_core}; medians of "
        f"{args.rounds} rounds of {args.seconds:g} s; load average {la[0]:.2f} {la[1]:.2f} "
        f"{la[2]:.2f}"
    )
    by = {r["path"]: r for r in rows}
    envoy = by.get("envoy")
    print(f"{'path':34} {'req/s':>8} {'CPU ms/req':>10} {'x envoy req/s':>13} "
          f"{'x envoy CPU':>11} {'errors':>6}")  # fmt: skip
    for r in rows:
        ratio = cpu = ""
        if envoy is not None:
            ratio = f"{r['rps'] / envoy['rps']:.2f}"
            cpu = f"{r['cpu_ms_per_request'] / envoy['cpu_ms_per_request']:.2f}"
        print(f"{r['path']:34} {r['rps']:>8.0f} {r['cpu_ms_per_request']:>10.3f} {ratio:>13} "
              f"{cpu:>11} {r['errors']:>6}")  # fmt: skip
    gateway = by["gateway"]
    if envoy is not None:
        rps = gateway["rps"] / envoy["rps"]
        cpu = gateway["cpu_ms_per_request"] / envoy["cpu_ms_per_request"]
        met = "met" if rps >= 0.25 and cpu <= 4 else "NOT met"
        print(f"target gateway >= 0.25x Envoy's req/s at <= 4x its CPU/request: {rps:.2f}x, "
              f"{cpu:.2f}x: {met}")  # fmt: skip
    if "envoy+epp" in by:
        ratio = by["envoy+epp"]["rps"] / gateway["rps"]
        met = "met" if ratio >= 0.5 else "NOT met"
        print(f"target Envoy + picker >= 0.5x the gateway's req/s: {ratio:.2f}x: {met}")
