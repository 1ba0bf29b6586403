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

Precise prefix routing (spec.routing.prefixIndex precise, issue #20): the contender
`precise` is `prefix-aware` scored from the simulators' own KV-cache events (each replica
publishes on its own ports, the gateway follows them with `--tokenizer m=simulator`),
`approximate` is `prefix-aware` as before (the index of what the gateway sent). Its three
workloads, each with its own KV pool per replica (`--num-blocks` overrides):
- `pressure`: 64 tenants' prefixes of 1.5-2.5k tokens with Zipf(1.0) popularity, about
  twice the fleet's KV pool (1,000 blocks of 16 tokens per replica), a short unique
  question after each;
- `nopressure`: 8 tenants' prefixes that fit (Zipf too);
- `multiturn`: chat sessions of 3-6 turns, each turn carrying the whole history (the
  engine's own answers included) over 8 shared system prompts of ~1.2k tokens (Zipf),
  sessions starting as a Poisson process, a think time between turns; 350 blocks per
  replica, so the sessions' histories do not all fit.
`--workloads precise` runs the three with `--policies` defaulting to precise, approximate,
least-load and vllm-router:cache_aware, prints the best hit rate any routing could reach
(`ideal`: one replica with an unbounded cache, from the prompts actually sent), and the
verdict against issue #20's targets. `--quick` halves the requests.

Times are simulated seconds: with --time-scale S the simulator runs S times
slower than real time (so a 2-core machine can drive it) and wall figures are
divided by S.

    python -m bench.gateway_routing                       # full default sweep
    python -m bench.gateway_routing --rates 6 --requests 60 --workloads shared
    python -m bench.gateway_routing --policies prefix-aware,vllm-router:cache_aware
    python -m bench.gateway_routing --policies prefix-aware,envoy+epp:prefix-aware
    python -m bench.gateway_routing --workloads precise --quick
    (the peer comes from the bench-peers extra: pip install -e ".[bench-peers]")

`--baseline-python PY` with a policy named `POLICY@landed` (for example
`--policies prefix-aware,prefix-aware@landed`): the gateways of that policy run with PY,
an interpreter whose `kubellm` is the landed checkout, beside this one's in the same run.

Several gateways: `--gateways 1,2` runs each case with one gateway and with two,
one right after the other. A run's hit rate moves by a few points from one seed
(or one run) to the next: which replica a hot prefix spills to when its home
passes the load bound depends on the exact timing. So `--seeds 7,11,13` repeats
every case per seed; with more than one seed a mean row follows each case, and
the ratio of the mean hit rates, N gateways to one, is printed per workload,
policy and rate (the target: at least 0.90), then the same seed by seed (`paired`: the
mean difference with its 95% interval, and issue 28's verdict, within 2% of one front
end: met, missed, or undecided when the interval straddles it). Single seeds move by
+-6 points; 6 seeds of 96 requests put the interval at about +-1.3 points.

Prints a table and writes JSON (--out, default bench/results/gateway_routing.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench import _client
from bench._fleet import Processes, free_port, wait_healthy
from kubellm import kv_blocks, metrics
from kubellm.bench.stats import percentile
from kubellm.fleet.processes import free_port_pair
from kubellm.sim_text import ApproxTokens, render_chat

WORDS = [
    "kube", "cluster", "replica", "prefix", "cache", "token", "decode", "prefill",
    "gateway", "router", "engine", "latency", "budget", "queue", "pool", "block",
    "scheduler", "batch", "model", "weight", "memory", "tensor",
]  # fmt: skip


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


PRECISE_WORKLOADS = ("pressure", "nopressure", "multiturn")
PRECISE_POLICIES = "precise,approximate,least-load,vllm-router:cache_aware"
# per workload: KV blocks per replica, arrivals (or session starts) per wall second, size
PRECISE_DEFAULTS = {
    "pressure": {"num_blocks": 1000, "rate": 3.0, "requests": 240},
    "nopressure": {"num_blocks": 1000, "rate": 3.0, "requests": 160},
    "multiturn": {"num_blocks": 350, "rate": 0.8, "requests": 60},  # requests: sessions
}
BLOCK = 16  # the llama-3.1-8b-h100 profile's block size


def zipf_choice(rng: random.Random, count: int, s: float = 1.0) -> int:
    weights = [1 / (rank + 1) ** s for rank in range(count)]
    return rng.choices(range(count), weights)[0]


def tenant_workload(kind: str, count: int, seed: int) -> list[list[dict[str, str]]]:
    """`pressure` (64 tenants) or `nopressure` (8): a tenant's prefix (Zipf-popular) and a
    short unique question."""
    rng = random.Random(seed)
    tenants = 64 if kind == "pressure" else 8
    prefixes = [f"tenant {t}: " + text_of_tokens(rng, rng.randint(1500, 2500))
                for t in range(tenants)]  # fmt: skip
    return [
        [{"role": "system", "content": prefixes[zipf_choice(rng, tenants)]},
         {"role": "user", "content": f"question {i}: " + text_of_tokens(rng, 40)}]
        for i in range(count)
    ]  # fmt: skip


def sessions_workload(count: int, seed: int) -> list[tuple[str, list[str]]]:
    """`multiturn`: (system prompt, the user's turns) per session, 3-6 turns each."""
    rng = random.Random(seed)
    systems = [f"assistant {k}: " + text_of_tokens(rng, rng.randint(1000, 1400))
               for k in range(8)]  # fmt: skip
    return [
        (systems[zipf_choice(rng, len(systems))],
         [f"session {i} turn {t}: " + text_of_tokens(rng, rng.randint(60, 160))
          for t in range(rng.randint(3, 6))])
        for i in range(count)
    ]  # fmt: skip


def ideal_hit_rate(prompts: list[list[dict[str, str]]], blocks: int | None = None) -> float:
    """The prefix-cache hit rate of one replica for these prompts in this order, with an
    unbounded cache (`blocks` None: an upper bound for any routing) or with an LRU cache of
    `blocks` blocks (the fleet's whole pool as one LRU: what routing that never duplicated
    a prefix and never split the pool's LRU order would reach). Blocks as the simulator
    hashes them, the last prompt token always recomputed; answers' own blocks are not
    reusable (the next turn re-tokenizes their text); running requests' blocks ignored."""
    tokens, hasher = ApproxTokens(), kv_blocks.BlockHasher(BLOCK)
    seen: dict[bytes, None] = {}
    hits = queries = 0
    for messages in prompts:
        ids = tokens.encode(render_chat(messages))
        hashes = hasher.raw(ids[:-1], max_blocks=1 << 30)
        matched = 0
        for h in hashes:
            if h not in seen:
                break
            matched += 1
        hits += matched * BLOCK
        queries += len(ids)
        for h in hashes:  # most recently used at the end
            seen.pop(h, None)
            seen[h] = None
        while blocks is not None and len(seen) > blocks:
            del seen[next(iter(seen))]
    return hits / queries if queries else 0.0


class Fleet(Processes):
    """Simulator and gateway processes for one run (bench/_fleet.py starts, logs and
    stops them); stopped on exit."""

    def __init__(self, args: argparse.Namespace, policy: str) -> None:
        super().__init__()
        # `POLICY@landed`: the gateways run by --baseline-python (the landed checkout)
        self.policy, landed, _ = policy.partition("@landed")
        if landed and not args.baseline_python:
            raise SystemExit(f"{policy}: needs --baseline-python")
        self.gateway_python = args.baseline_python if landed else sys.executable
        self.args = args
        self.engines: list[str] = []
        self.gateways: list[str] = []

    def _spawn(self, command: list[str]) -> subprocess.Popen:
        return self.spawn(command)

    def __enter__(self) -> Fleet:
        a = self.args
        precise = self.policy == "precise"
        events: list[int] = []
        for _ in range(a.replicas):
            port = free_port()
            command = [
                sys.executable, "-m", "kubellm.engine", "--backend", "sim", "--port", str(port),
                "--served-model-name", "m", "--profile", a.profile,
                "--time-scale", str(a.time_scale), "--num-blocks", str(a.num_blocks),
            ]  # fmt: skip
            if precise:  # its own KV-event ports, as `kubellm up` gives each local replica
                events.append(free_port_pair())
                command += ["--kv-events-port", str(events[-1])]
            process = self._spawn(command)
            self.engines.append(f"http://127.0.0.1:{port}")
            wait_healthy(self.engines[-1], process)
        if self.policy.startswith("vllm-router:"):
            self._start_vllm_router(self.policy.split(":", 1)[1])
            return self
        if self.policy.startswith("envoy+epp"):  # e.g. envoy+epp:prefix-aware
            self._start_envoy_epp(self.policy.partition(":")[2] or "prefix-aware")
            return self
        static = Path(self.tmp.name) / "static.yaml"
        routing: dict[str, Any] = {"policy": self.policy}
        endpoints: list[Any] = list(self.engines)
        gateway_flags: list[str] = []
        if self.policy == "approximate":
            routing = {"policy": "prefix-aware", "prefixIndex": "approximate"}
        elif precise:
            routing = {"policy": "prefix-aware", "prefixIndex": "precise"}
            endpoints = [
                {"url": u, "kvEventsPort": p} for u, p in zip(self.engines, events, strict=True)
            ]
            gateway_flags = ["--tokenizer", "m=simulator"]
        static.write_text(yaml.safe_dump({"models": [{
            "name": "m", "endpoints": endpoints, "routing": routing,
            "slo": {"ttftSeconds": a.ttft_slo * a.time_scale,
                    "itlSeconds": a.itl_slo * a.time_scale},
        }]}))  # fmt: skip
        for _ in range(a.gateways):
            port = free_port()
            process = self._spawn([
                self.gateway_python, "-m", "kubellm.gateway.cli", "--port", str(port),
                "--static", str(static), "--max-waiting", "1000000", "--max-kv-usage", "1.01",
                "--scrape-interval", "0.25", "--front-ends", str(a.gateways), *gateway_flags,
            ])  # fmt: skip
            self.gateways.append(f"http://127.0.0.1:{port}")
            wait_healthy(self.gateways[-1], process)
        if precise:  # the gateway follows every replica's events before traffic starts
            for url in self.gateways:
                wait_following(url)
        return self

    def _start_envoy_epp(self, policy: str) -> None:
        """Envoy asking `kubellm epp` (the Inference Extension's path), one per --gateways."""
        from bench.gateway import envoy as _envoy

        a = self.args
        slo = {"ttftSeconds": a.ttft_slo * a.time_scale, "itlSeconds": a.itl_slo * a.time_scale}
        for index in range(a.gateways):
            tmp = Path(self.tmp.name) / f"envoy{index}"
            tmp.mkdir()
            path = _envoy.start(
                self.engines, "m", tmp, policy=policy, settings={"slo": slo},
                epp_args=["--max-waiting", "1000000", "--max-kv-usage", "1.01",
                          "--scrape-interval", "0.25", "--front-ends", str(a.gateways)],
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


FALLBACKS = "kubellm_gateway_prefix_index_fallbacks_total"


def gateway_fallbacks(urls: list[str]) -> float:
    """Candidates the gateways scored approximately in precise mode (stale or unhashed)."""
    total = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
            total += sum(s.value for s in family.samples if s.name == FALLBACKS)
    return total


def wait_following(url: str, timeout: float = 20) -> None:
    """Until the gateway's precise index has answered replay probes: its subscriptions run
    from its first discovery pass; a probe answered within a second. The bench waits on
    the gauge the subscription loop sets, then one probe interval more (2 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics").text
        if "kubellm_gateway_kv_index_entries" in text:
            time.sleep(2.5)  # the first probe of every replica has been answered by now
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url}: the precise index never started")


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
    """One streamed chat request: TTFT, mean ITL and the answer's text (`bench._client`)."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens}
    return await _client.stream(client, url, body)


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


async def drive_sessions(
    fleet: Fleet, sessions: list[tuple[str, list[str]]], rate: float, args: argparse.Namespace
) -> dict:
    """Sessions start as a Poisson process at `rate` per wall second; each sends its turns
    one after the other, every turn carrying the whole history (the answers included),
    with an exponential think time (mean --think-time simulated seconds) between turns."""
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    results: list[dict] = []
    sent: list[list[dict[str, str]]] = []

    async def session(index: int, system: str, turns: list[str]) -> None:
        think = random.Random(args.seed * 1000 + index)
        messages = [{"role": "system", "content": system}]
        url = fleet.gateways[index % len(fleet.gateways)]
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            sent.append(list(messages))
            result = await one_request(client, url, list(messages), args.max_tokens)
            results.append(result)
            messages.append({"role": "assistant", "content": result.get("text") or "ok"})
            await asyncio.sleep(think.expovariate(1 / args.think_time) * args.time_scale)

    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        tasks = []
        start = time.monotonic()
        for i, (system, turns) in enumerate(sessions):
            tasks.append(asyncio.create_task(session(i, system, turns)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        wall = time.monotonic() - start
    return {"results": results, "wall": wall, "sent": sent}


def quantile(values: list[float], q: float) -> float | None:
    """The `q` quantile (0-1) as `kubellm.bench.stats.percentile` defines it (interpolated,
    numpy's default: the one definition of every figure the benchmarks print)."""
    return percentile(values, 100 * q)


def run_one(args: argparse.Namespace, kind: str, policy: str, rate: float) -> dict[str, Any]:
    """One run: `args.seed` and `args.gateways` (one number each) say which."""
    sessions: list[tuple[str, list[str]]] = []
    if kind == "multiturn":
        sessions = sessions_workload(args.requests, args.seed)
    elif kind in PRECISE_WORKLOADS:
        prompts = tenant_workload(kind, args.requests, args.seed)
    else:
        prompts = workload(kind, args.requests, args.seed)
    fallbacks = None
    with Fleet(args, policy) as fleet:
        q0, h0 = engine_counters(fleet.engines)
        if sessions:
            outcome = asyncio.run(drive_sessions(fleet, sessions, rate, args))
            prompts = outcome["sent"]
        else:
            outcome = asyncio.run(drive(fleet, prompts, rate, args))
        q1, h1 = engine_counters(fleet.engines)
        if policy == "precise":
            fallbacks = gateway_fallbacks(fleet.gateways)
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
        "num_blocks": args.num_blocks, "approx_scored": fallbacks,
        "ideal_hit_rate": ideal_hit_rate(prompts) if kind in PRECISE_WORKLOADS else None,
        "pooled_lru_hit_rate": ideal_hit_rate(prompts, args.num_blocks * args.replicas)
        if kind in PRECISE_WORKLOADS else None,
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


# Student's t, two-sided 95%, by degrees of freedom (more: 2.0)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 11: 2.20, 12: 2.18, 15: 2.13, 20: 2.09}  # fmt: skip


def paired(one: list[dict[str, Any]], many: list[dict[str, Any]], within: float = 0.02) -> str:
    """N front ends against one, seed by seed (the same workload each time): the mean
    difference of the hit rate in points with its 95% interval, as a ratio interval, and
    issue 28's verdict (within 2% of one front end): met when the whole interval is within,
    missed when none of it is, else undecided (more seeds or requests)."""
    diffs = [m["hit_rate"] - o["hit_rate"] for o, m in zip(one, many, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = (sum((d - mean) ** 2 for d in diffs) / (n - 1)) ** 0.5 if n > 1 else 0.0
    t = _T95.get(n - 1) or next((v for k, v in sorted(_T95.items()) if k >= n - 1), 2.0)
    half = t * sd / n**0.5
    base = sum(o["hit_rate"] for o in one) / n
    low, high = 1 + (mean - half) / base, 1 + (mean + half) / base
    verdict = "met" if low >= 1 - within else "MISSED" if high < 1 - within else "undecided"
    return (
        f"paired over {n} seeds: {100 * mean:+.2f} +- {100 * half:.2f} points (95%; seeds' "
        f"sd {100 * sd:.2f}), ratio {low:.3f}-{high:.3f} (within {100 * within:g}%: {verdict})"
    )


def precise_verdict(rows: list[dict[str, Any]]) -> list[str]:
    """Issue #20's targets, checked on the precise workloads' rows (one gateway) and printed:
    under pressure precise >= approximate + 10 points of hit rate with a lower TTFT p95;
    multi-turn hit rate >= vllm-router cache_aware's with a TTFT p95 no worse than
    approximate's; without pressure within 2 points of approximate."""
    by = {(r["workload"], r["policy"]): r for r in rows if r["gateways"] == 1}
    out: list[str] = []

    def row(kind: str, policy: str) -> dict[str, Any] | None:
        return by.get((kind, policy))

    def say(line: str) -> None:
        out.append(line)
        print(line, flush=True)

    for kind in PRECISE_WORKLOADS:
        precise, approx = row(kind, "precise"), row(kind, "approximate")
        if precise is None or approx is None:
            continue
        ideal = precise.get("ideal_hit_rate")
        say(f"{kind}: ideal hit rate (one replica, unbounded cache) {fmt(ideal, '.1%')}, "
            f"the fleet's pool as one LRU {fmt(precise.get('pooled_lru_hit_rate'), '.1%')}; "
            f"precise scored {fmt(precise.get('approx_scored'), '.0f')} candidates "
            f"approximately")  # fmt: skip
        gap = precise["hit_rate"] - approx["hit_rate"]
        p95 = (precise["ttft_p95"] or 0, approx["ttft_p95"] or 0)
        if kind == "pressure":
            met = gap >= 0.10 and p95[0] < p95[1]
            say(
                f"  pressure: precise {precise['hit_rate']:.1%} vs approximate "
                f"{approx['hit_rate']:.1%} ({gap * 100:+.1f} points, target >= +10), TTFT p95 "
                f"{p95[0]:.3f} vs {p95[1]:.3f} s (target lower): {'met' if met else 'MISSED'}"
            )
        elif kind == "nopressure":
            met = abs(gap) <= 0.02
            say(
                f"  no pressure: precise {precise['hit_rate']:.1%} vs approximate "
                f"{approx['hit_rate']:.1%} ({gap * 100:+.1f} points, target within 2): "
                f"{'met' if met else 'MISSED'}"
            )
        else:
            peer = row(kind, "vllm-router:cache_aware")
            if peer is None:
                continue
            met = precise["hit_rate"] >= peer["hit_rate"] and p95[0] <= p95[1]
            say(
                f"  multi-turn: precise {precise['hit_rate']:.1%} vs vllm-router cache_aware "
                f"{peer['hit_rate']:.1%} (target >=), TTFT p95 {p95[0]:.3f} vs approximate "
                f"{p95[1]:.3f} s (target no worse): {'met' if met else 'MISSED'}"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--workloads",
        default="shared,low",
        help="shared, low, pressure, nopressure, multiturn; precise = the last three",
    )
    p.add_argument(
        "--policies",
        default=None,
        help="default prefix-aware,least-load,round-robin; for the precise "
        f"workloads {PRECISE_POLICIES}",
    )
    p.add_argument(
        "--rates",
        default=None,
        help="arrivals (multiturn: session starts) per "
        "WALL second, comma-separated (default 4,8; precise workloads: their own)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per run (multiturn: sessions); default 96 or the workload's",
    )
    p.add_argument("--quick", action="store_true", help="half the requests (precise workloads)")
    p.add_argument(
        "--think-time",
        type=float,
        default=2.0,
        help="multiturn: mean simulated seconds between a session's turns",
    )
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--gateways", default="1", help="gateway processes, comma-separated: 1,2")
    p.add_argument("--profile", default="llama-3.1-8b-h100")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks per replica (default 2000; precise workloads: their own)",
    )
    p.add_argument("--time-scale", type=float, default=4.0)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--ttft-slo", type=float, default=0.5, help="simulated seconds")
    p.add_argument("--itl-slo", type=float, default=0.05, help="simulated seconds")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--seeds", "--seed", default="7", help="workload seeds, comma-separated")
    p.add_argument(
        "--baseline-python",
        metavar="PY",
        help="the interpreter of another checkout (the landed code): a policy named "
        "POLICY@landed runs its gateways with it, beside this checkout's in the same run",
    )
    p.add_argument("--out", default="bench/results/gateway_routing.json")
    args = p.parse_args(argv)
    kinds = [k for w in args.workloads.split(",")
             for k in (PRECISE_WORKLOADS if w == "precise" else (w,))]  # fmt: skip
    seeds = [int(s) for s in args.seeds.split(",")]
    gateway_counts = [int(g) for g in args.gateways.split(",")]

    rows: list[dict[str, Any]] = []
    means: list[dict[str, Any]] = []
    header = (f"{'workload':8} {'policy':24} {'gw':>2} {'seed':>5} {'rate/s':>7} {'ok':>4} "
              f"{'hit':>6} {'ttft50':>7} {'ttft95':>7} {'itl95':>7} {'goodput/s':>9}")  # fmt: skip
    print(header, flush=True)
    for kind in kinds:
        defaults = PRECISE_DEFAULTS.get(kind, {"num_blocks": 2000, "rate": None, "requests": 96})
        policies = args.policies or (
            PRECISE_POLICIES if kind in PRECISE_WORKLOADS else "prefix-aware,least-load,round-robin"
        )
        rates = args.rates or (str(defaults["rate"]) if defaults["rate"] else "4,8")
        requests = args.requests or defaults["requests"] // (2 if args.quick else 1)
        blocks = args.num_blocks or defaults["num_blocks"]
        for rate in (float(r) for r in rates.split(",")):
            for policy in policies.split(","):
                case: dict[int, list[dict[str, Any]]] = {g: [] for g in gateway_counts}
                for seed in seeds:  # one gateway count right after the other, per seed
                    for gateways in gateway_counts:
                        run = argparse.Namespace(**{**vars(args), "seed": seed,
                                                    "gateways": gateways, "requests": requests,
                                                    "num_blocks": blocks})  # fmt: skip
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
                        if len(seeds) > 1:
                            print(f"{kind:8} {policy:24} {paired(case[1], case[gateways])}",
                                  flush=True)  # fmt: skip
    verdicts = precise_verdict(means if len(seeds) > 1 else rows)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "means": means,
                                          "verdicts": verdicts}, indent=2))  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
