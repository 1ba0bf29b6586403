"""Routing quality: what prefix-aware routing buys over least-load and round-robin.

Four simulated replicas (kubellm.engine's simulator, profile llama-3.1-8b-h100,
KV pool cut to --num-blocks so that the prompts' working set does not fit in
one replica but fits across all four) behind one gateway process (or two with
--gateways 2, requests split round-robin between them). For each workload,
policy and arrival rate: Poisson arrivals of streaming chat requests; measured
at the client: TTFT p50/p95, mean-ITL p95, goodput (requests/s meeting both
SLO targets); from the engines' own metrics: prefix-cache hit rate (tokens hit
/ tokens queried).

Contenders: the gateway's policies (`prefix-aware`, `least-load`,
`round-robin`) and the Rust `vllm-router` from PyPI, named
`vllm-router:POLICY` (for example `vllm-router:cache_aware`,
`vllm-router:power_of_two`), started in the gateway's place in front of the
same replicas (its executable is looked up next to this Python, then on PATH);
and `envoy+epp:POLICY`, the Gateway API Inference Extension's path: a real Envoy asking
`kubellm epp` (the same routing core as the gateway, with POLICY) where each request goes.

Workloads: `shared` = 32 system prompts of 1-4k tokens, each request one of
them plus a short unique question; `low` = unique prompts of 1-4k tokens.

Times are simulated seconds: with --time-scale S the simulator runs S times
slower than real time (so a 2-core machine can drive it) and wall figures are
divided by S.

    python bench/gateway_routing.py                       # full default sweep
    python bench/gateway_routing.py --rates 6 --requests 60 --workloads shared
    python bench/gateway_routing.py --policies prefix-aware,vllm-router:cache_aware
    python bench/gateway_routing.py --policies prefix-aware,envoy+epp:prefix-aware
    (the peer comes from the bench-peers extra: pip install -e ".[bench-peers]")

Several gateways: `--gateways 1,2` runs each case with one gateway and with two,
one right after the other. A run's hit rate moves by a few points from one seed
(or one run) to the next: which replica a hot prefix spills to when its home
passes the load bound depends on the exact timing. So `--seeds 7,11,13` repeats
every case per seed; with more than one seed a mean row follows each case, and
the ratio of the mean hit rates, N gateways to one, is printed per workload,
policy and rate (the target: at least 0.90).

Prints a table and writes JSON (--out, default bench/results/gateway_routing.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics

WORDS = [
    "kube", "cluster", "replica", "prefix", "cache", "token", "decode", "prefill",
    "gateway", "router", "engine", "latency", "budget", "queue", "pool", "block",
    "scheduler", "batch", "model", "weight", "memory", "tensor",
]  # fmt: skip


_TOKEN = re.compile(r'"content":\s*"[^"]')  # a chunk with text, not the empty role chunk


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text_of_tokens(rng: random.Random, tokens: int) -> str:
    """About `tokens` simulator tokens (~4 characters each)."""
    out, size = [], 0
    while size < tokens * 4:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def workload(kind: str, count: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    if kind == "shared":
        systems = [text_of_tokens(rng, rng.randint(1000, 4000)) for _ in range(32)]
        return [
            [{"role": "system", "content": rng.choice(systems)},
             {"role": "user", "content": f"question {i}: " + text_of_tokens(rng, 40)}]
            for i in range(count)
        ]  # fmt: skip
    return [
        [{"role": "user", "content": f"{i} " + text_of_tokens(rng, rng.randint(1000, 4000))}]
        for i in range(count)
    ]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = getattr(process, "log_path", None)
            tail = Path(log).read_text()[-2000:] if log else ""
            raise RuntimeError(f"{url} exited with {process.returncode}\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


class Fleet:
    """Simulator and gateway processes for one run; stopped on exit."""

    def __init__(self, args: argparse.Namespace, policy: str) -> None:
        self.args, self.policy = args, policy
        self.processes: list[subprocess.Popen] = []
        self.engines: list[str] = []
        self.gateways: list[str] = []
        self.stoppers: list[Callable[[], None]] = []
        self.tmp = tempfile.TemporaryDirectory()

    def _spawn(self, command: list[str]) -> subprocess.Popen:
        log = open(Path(self.tmp.name) / f"p{len(self.processes)}.log", "w")  # noqa: SIM115
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        process.log_path = log.name  # type: ignore[attr-defined]
        self.processes.append(process)
        return process

    def __enter__(self) -> Fleet:
        a = self.args
        for _ in range(a.replicas):
            port = free_port()
            process = self._spawn([
                sys.executable, "-m", "kubellm.engine", "--backend", "sim", "--port", str(port),
                "--served-model-name", "m", "--profile", a.profile,
                "--time-scale", str(a.time_scale), "--num-blocks", str(a.num_blocks),
            ])  # fmt: skip
            self.engines.append(f"http://127.0.0.1:{port}")
            wait_healthy(self.engines[-1], process)
        if self.policy.startswith("vllm-router:"):
            self._start_vllm_router(self.policy.split(":", 1)[1])
            return self
        if self.policy.startswith("envoy+epp"):  # e.g. envoy+epp:prefix-aware
            self._start_envoy_epp(self.policy.partition(":")[2] or "prefix-aware")
            return self
        static = Path(self.tmp.name) / "static.yaml"
        static.write_text(yaml.safe_dump({"models": [{
            "name": "m", "endpoints": self.engines, "routing": {"policy": self.policy},
            "slo": {"ttftSeconds": a.ttft_slo * a.time_scale,
                    "itlSeconds": a.itl_slo * a.time_scale},
        }]}))  # fmt: skip
        for _ in range(a.gateways):
            port = free_port()
            process = self._spawn([
                sys.executable, "-m", "kubellm.gateway.cli", "--port", str(port),
                "--static", str(static), "--max-waiting", "1000000", "--max-kv-usage", "1.01",
                "--scrape-interval", "0.25",
            ])  # fmt: skip
            self.gateways.append(f"http://127.0.0.1:{port}")
            wait_healthy(self.gateways[-1], process)
        return self

    def _start_envoy_epp(self, policy: str) -> None:
        """Envoy asking `kubellm epp` (the Inference Extension's path), one per --gateways."""
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import _envoy

        a = self.args
        slo = {"ttftSeconds": a.ttft_slo * a.time_scale, "itlSeconds": a.itl_slo * a.time_scale}
        for index in range(a.gateways):
            tmp = Path(self.tmp.name) / f"envoy{index}"
            tmp.mkdir()
            path = _envoy.start(
                self.engines, "m", tmp, policy=policy, settings={"slo": slo},
                epp_args=["--max-waiting", "1000000", "--max-kv-usage", "1.01",
                          "--scrape-interval", "0.25"],
            )  # fmt: skip
            self.stoppers.append(path.stop)
            self.gateways.append(path.url)

    def _start_vllm_router(self, policy: str) -> None:
        """The Rust vllm-router (PyPI `vllm-router`) in the gateway's place, one per --gateways."""
        local = Path(sys.executable).with_name("vllm-router")
        binary = str(local) if local.exists() else shutil.which("vllm-router")
        if binary is None:
            raise SystemExit("vllm-router not found: pip install vllm-router")
        for _ in range(self.args.gateways):
            port = free_port()
            process = self._spawn([
                binary, "--port", str(port), "--policy", policy,
                "--worker-urls", *self.engines, "--prometheus-port", str(free_port()),
                "--log-level", "warning",
            ])  # fmt: skip
            self.gateways.append(f"http://127.0.0.1:{port}")
            wait_healthy(self.gateways[-1], process)

    def __exit__(self, *exc: object) -> None:
        for stop in self.stoppers:
            stop()
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        self.tmp.cleanup()


def engine_counters(urls: list[str]) -> tuple[float, float]:
    queries = hits = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
            for sample in family.samples:
                if sample.name == metrics.PREFIX_CACHE_QUERIES:
                    queries += sample.value
                elif sample.name == metrics.PREFIX_CACHE_HITS:
                    hits += sample.value
    return queries, hits


async def one_request(client: httpx.AsyncClient, url: str, messages: list, max_tokens: int) -> dict:
    start = time.monotonic()
    times: list[float] = []
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return {"ok": False, "status": response.status_code}
            async for line in response.aiter_lines():
                if line.startswith("data: {") and _TOKEN.search(line):
                    times.append(time.monotonic())
    except httpx.HTTPError as error:
        return {"ok": False, "status": type(error).__name__}
    if not times:
        return {"ok": False, "status": "empty"}
    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return {"ok": True, "ttft": times[0] - start, "itl": itl}


async def drive(fleet: Fleet, prompts: list, rate: float, args: argparse.Namespace) -> dict:
    """Open-loop Poisson arrivals at `rate` requests per wall second."""
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        tasks = []
        start = time.monotonic()
        for i, messages in enumerate(prompts):
            url = fleet.gateways[i % len(fleet.gateways)]
            tasks.append(asyncio.create_task(one_request(client, url, messages, args.max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.monotonic() - start
    return {"results": results, "wall": wall}


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_one(args: argparse.Namespace, kind: str, policy: str, rate: float) -> dict[str, Any]:
    """One run: `args.seed` and `args.gateways` (one number each) say which."""
    prompts = workload(kind, args.requests, args.seed)
    with Fleet(args, policy) as fleet:
        q0, h0 = engine_counters(fleet.engines)
        outcome = asyncio.run(drive(fleet, prompts, rate, args))
        q1, h1 = engine_counters(fleet.engines)
    s = args.time_scale
    ok = [r for r in outcome["results"] if r["ok"]]
    ttfts = [r["ttft"] / s for r in ok]
    itls = [r["itl"] / s for r in ok]
    good = sum(1 for r in ok if r["ttft"] / s <= args.ttft_slo and r["itl"] / s <= args.itl_slo)
    sim_seconds = outcome["wall"] / s
    return {
        "workload": kind, "policy": policy, "gateways": args.gateways, "seed": args.seed,
        "rate_per_sim_s": rate / (1 / s), "requests": len(prompts), "ok": len(ok),
        "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "ttft_p50": quantile(ttfts, 0.5), "ttft_p95": quantile(ttfts, 0.95),
        "itl_p95": quantile(itls, 0.95),
        "goodput_rps": good / sim_seconds, "slo_met_share": good / len(prompts),
    }  # fmt: skip


def fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_row(row: dict[str, Any], seed: str) -> None:
    print(f"{row['workload']:8} {row['policy']:24} {row['gateways']:>2} {seed:>5} "
          f"{row['rate_per_sim_s']:>7.2f} {row['ok']:>4} {row['hit_rate']:>6.1%} "
          f"{fmt(row['ttft_p50']):>7} {fmt(row['ttft_p95']):>7} {fmt(row['itl_p95'], '.4f'):>7} "
          f"{row['goodput_rps']:>9.2f}", flush=True)  # fmt: skip


def mean_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one case (seeds differ) averaged: counts and rates, quantiles too."""
    out = dict(rows[0])
    for key in ("ok", "hit_rate", "ttft_p50", "ttft_p95", "itl_p95", "goodput_rps"):
        values = [r[key] for r in rows if r[key] is not None]
        out[key] = sum(values) / len(values) if values else None
    out["seed"] = "mean"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="shared,low")
    p.add_argument("--policies", default="prefix-aware,least-load,round-robin")
    p.add_argument("--rates", default="4,8", help="arrivals per WALL second, comma-separated")
    p.add_argument("--requests", type=int, default=96, help="requests per run")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--gateways", default="1", help="gateway processes, comma-separated: 1,2")
    p.add_argument("--profile", default="llama-3.1-8b-h100")
    p.add_argument("--num-blocks", type=int, default=2000, help="KV blocks per replica")
    p.add_argument("--time-scale", type=float, default=4.0)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--ttft-slo", type=float, default=0.5, help="simulated seconds")
    p.add_argument("--itl-slo", type=float, default=0.05, help="simulated seconds")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--seeds", "--seed", default="7", help="workload seeds, comma-separated")
    p.add_argument("--out", default="bench/results/gateway_routing.json")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    gateway_counts = [int(g) for g in args.gateways.split(",")]

    rows: list[dict[str, Any]] = []
    means: list[dict[str, Any]] = []
    header = (f"{'workload':8} {'policy':24} {'gw':>2} {'seed':>5} {'rate/s':>7} {'ok':>4} "
              f"{'hit':>6} {'ttft50':>7} {'ttft95':>7} {'itl95':>7} {'goodput/s':>9}")  # fmt: skip
    print(header, flush=True)
    for kind in args.workloads.split(","):
        for rate in (float(r) for r in args.rates.split(",")):
            for policy in args.policies.split(","):
                case: dict[int, list[dict[str, Any]]] = {g: [] for g in gateway_counts}
                for seed in seeds:  # one gateway count right after the other, per seed
                    for gateways in gateway_counts:
                        run = argparse.Namespace(**{**vars(args), "seed": seed,
                                                    "gateways": gateways})  # fmt: skip
                        row = run_one(run, kind, policy, rate)
                        rows.append(row)
                        case[gateways].append(row)
                        print_row(row, str(seed))
                        out = Path(args.out)  # written after each run: a failed run keeps the rest
                        out.parent.mkdir(parents=True, exist_ok=True)
                        out.write_text(json.dumps(
                            {"args": vars(args), "rows": rows, "means": means}, indent=2
                        ))  # fmt: skip
                if len(seeds) > 1:
                    for gateways in gateway_counts:
                        means.append(mean_row(case[gateways]))
                        print_row(means[-1], "mean")
                one = mean_row(case[1])["hit_rate"] if 1 in case else None
                for gateways in gateway_counts:
                    if one and gateways != 1:
                        ratio = mean_row(case[gateways])["hit_rate"] / one
                        print(f"{kind:8} {policy:24} hit rate, {gateways} gateways / 1: "
                              f"{ratio:.3f} over {len(seeds)} seed(s) (target >= 0.90: "
                              f"{'met' if ratio >= 0.9 else 'MISSED'})", flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "means": means},
                                         indent=2))  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
