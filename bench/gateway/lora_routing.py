"""LoRA routing: what adapter affinity buys over adapter-blind routing.

Four simulated replicas (kubellm.engine's simulator, profile llama-3.1-8b-h100, LoRA on
with `maxLoras` 2: two adapter slots per replica, LRU, 50 ms to load an adapter into a
slot, see kubellm.engine.sim_profiles) serve one base model and 12 adapters, all
registered on every replica at start (as vLLM's --lora-modules does), behind one
gateway. Requests name an adapter drawn from a Zipf distribution (exponent --zipf, 1.0:
the most used adapter gets 1/H(12) = 32% of the traffic, the least used 2.7%); prompts
are unique (no shared prefix, so prefix affinity plays no part), Poisson arrivals.

Contenders: the gateway with `--adapter-routing affinity` (the default: requests go
where their adapter is in a slot, within the bounded-load filter) and `blind` (the same
gateway and policy, the adapter ignored). Both use the `least-load` policy.

Measured: adapter loads per 1,000 requests (the simulator's kubellm_sim_lora_loads_total,
summed over replicas; each load is 50 ms of a replica's step time and any adapter beyond
the batch's two waits for a slot), TTFT p50/p95 and goodput (requests/s meeting both SLO
targets) at the client, in simulated seconds (--time-scale S: the simulator runs S times
slower than real time so a 2-core machine can drive it; figures are divided by S).

    python -m bench.lora_routing                         # the default case
    python -m bench.lora_routing --requests 600 --rate 24 --seeds 1,2,3

Before measuring it prints what is possible on this workload, in expectation for
independent requests (each request's adapter drawn independently, the Zipf weights):
adapter-blind routing sends every adapter everywhere, so each replica's 2 slots are an LRU
over all 12 adapters (its exact miss rate); an ideal router places adapters in the 8 slots
(the hottest resident, the hottest on several replicas, swap slots for the rest: each swap
slot's misses are those of A0, which keeps the last adapter asked for), found by search
among placements that keep every replica within loadBound x the mean share, and with no
bound. Their ratio is the best reduction any router can show here; the routing core's own
plan (`plan_placement`) is printed beside it. These ignore time: requests that overlap
share one load (so measured counts are lower), and a slot busy with one adapter cannot
take another at once (so a single swap slot is optimistic).

Prints a table and writes JSON (--out, default bench/results/lora_routing.json).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench import _client
from bench._fleet import Processes, free_port, wait_healthy
from kubellm.bench.stats import percentile

SIM_LORA_LOADS = "kubellm_sim_lora_loads_total"

WORDS = ["adapter", "tenant", "lora", "slot", "rank", "weight", "prompt", "answer", "team",
         "support", "ticket", "query", "summary", "contract", "invoice", "report"]  # fmt: skip


def zipf_weights(n: int, exponent: float) -> list[float]:
    raw = [1 / (rank**exponent) for rank in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def lru_miss_rate(p: list[float], slots: int) -> float:
    """Miss rate of an LRU cache of `slots` items under independent requests with
    probabilities `p` (exact: the stationary law of LRU's ordered contents)."""
    total = 0.0
    for state in itertools.permutations(range(len(p)), slots):
        prob, used = 1.0, 0.0
        for i in state:
            prob *= p[i] / (1.0 - used)
            used += p[i]
        total += prob * (1.0 - sum(p[i] for i in state))
    return total


def swap_misses(p: list[float], group: list[int]) -> float:
    """Misses per request of one slot that swaps the adapters `group` (A0: it holds the
    last one asked for): sum of p_i x (1 - p_i / P(group))."""
    share = sum(p[i] for i in group)
    return 0.0 if share == 0 else share - sum(p[i] ** 2 for i in group) / share


def _partitions(items: list[int], blocks: int) -> Iterator[list[list[int]]]:
    if blocks == 0:
        if not items:
            yield []
        return
    if len(items) < blocks:
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest, blocks - 1):
        yield [[first], *part]
    for part in _partitions(rest, blocks):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def _busiest(shares: list[float], replicas: int) -> float:
    """The busiest replica's share when slots are dealt to replicas in snake order, largest
    first (r1..rR, then rR..r1, ...): with 2 slots each, the hottest slot paired with the
    coldest, which minimises the busiest pair."""
    loads = [0.0] * replicas
    for i, share in enumerate(sorted(shares, reverse=True)):
        turn, pos = divmod(i, replicas)
        loads[pos if turn % 2 == 0 else replicas - 1 - pos] += share
    return max(loads)


def best_placement(
    p: list[float], replicas: int, slots: int, load_bound: float | None
) -> tuple[float, str]:
    """The fewest expected misses per request over placements of the adapters (p sorted,
    hottest first) in replicas x slots slots: the m hottest resident (the 3 hottest on up
    to `replicas` slots each, their requests split evenly), the others split among the
    remaining swap slots (at most 4 groups); only placements whose busiest replica takes
    at most load_bound / replicas of the requests (slots dealt as `_busiest` says).
    Returns (misses, a description)."""
    total, n = replicas * slots, len(p)
    best: tuple[float, str] = (float("inf"), "")
    for m in range(min(n, total) + 1):
        for head in itertools.product(range(1, replicas + 1), repeat=min(m, 3)):
            copies = [*head, *[1] * (m - len(head))]
            swaps, tail = total - sum(copies), list(range(m, n))
            if swaps < 0 or (tail and not 1 <= swaps <= min(4, len(tail))):
                continue
            for groups in _partitions(tail, swaps) if tail else iter([[]]):
                misses = sum(swap_misses(p, g) for g in groups)
                if misses >= best[0]:
                    continue
                shares = [p[i] / c for i, c in enumerate(copies) for _ in range(c)]
                shares += [sum(p[i] for i in g) for g in groups]
                busiest = _busiest(shares + [0.0] * (total - len(shares)), replicas)
                if load_bound is None or busiest <= load_bound / replicas + 1e-12:
                    alone = [g[0] for g in groups if len(g) == 1]  # a slot of its own
                    pinned = [
                        f"#{i + 1}" + (f"x{c}" if c > 1 else "") for i, c in enumerate(copies)
                    ] + [f"#{i + 1}" for i in alone]
                    swapped = ["#" + ",#".join(str(i + 1) for i in g) for g in groups
                               if len(g) > 1]  # fmt: skip
                    best = (misses, f"resident {', '.join(pinned)}; swapping "
                                    f"{'; '.join(swapped) or '-'}; busiest replica "
                                    f"{busiest:.0%} of requests")  # fmt: skip
    return best


def plan_misses(p: list[float], replicas: int, slots: int, load_bound: float) -> float:
    """Expected misses per request of the routing core's own placement plan."""
    from kubellm.gateway.routing.replicas.adapters import plan_placement

    demand = {f"a{i:02d}": share for i, share in enumerate(p)}
    urls = [f"r{i}" for i in range(replicas)]
    plan = plan_placement(demand, urls, slots, load_bound)
    tail = [i for i, name in enumerate(demand) if name not in plan.homes]
    return swap_misses(p, tail) if tail else 0.0


def print_bound(args: argparse.Namespace) -> dict[str, float]:
    """What any router can do on this workload, in expectation (see the module's help)."""
    p = zipf_weights(args.adapters, args.zipf)
    blind = 1000 * lru_miss_rate(p, args.max_loras)
    bounded, how = best_placement(p, args.replicas, args.max_loras, args.load_bound)
    free, how_free = best_placement(p, args.replicas, args.max_loras, None)
    plan = 1000 * plan_misses(p, args.replicas, args.max_loras, args.load_bound)
    print(f"expected loads per 1,000 requests (independent requests, no overlap): blind "
          f"{blind:.0f}; ideal within loadBound {args.load_bound:g} {1000 * bounded:.0f} "
          f"({how}) = {blind / (1000 * bounded):.1f}x fewer; ideal with no bound "
          f"{1000 * free:.0f} ({how_free}) = {blind / (1000 * free):.1f}x; the routing core's "
          f"plan {plan:.0f}")  # fmt: skip
    return {"blind": blind, "ideal_bounded": 1000 * bounded, "ideal_unbounded": 1000 * free,
            "plan": plan}  # fmt: skip


def workload(args: argparse.Namespace, seed: int) -> list[tuple[str, str]]:
    """(adapter, prompt) per request: Zipf-popular adapters, unique prompts of 200-600 words."""
    rng = random.Random(seed)
    names = [f"team-{i:02d}" for i in range(args.adapters)]
    weights = zipf_weights(args.adapters, args.zipf)
    out = []
    for i in range(args.requests):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 600)))
        out.append((rng.choices(names, weights)[0], f"request {i} {seed}: {words}"))
    return out


class Fleet(Processes):
    """Simulated replicas and one gateway, in processes (bench/_fleet.py starts, logs and
    stops them); stopped on exit."""

    def __init__(self, args: argparse.Namespace, routing: str) -> None:
        super().__init__()
        self.args, self.routing = args, routing
        self.engines: list[str] = []
        self.gateway = ""

    def _spawn(self, command: list[str]) -> subprocess.Popen:
        return self.spawn(command)

    def __enter__(self) -> Fleet:
        a = self.args
        adapters = {f"team-{i:02d}": f"/adapters/team-{i:02d}" for i in range(a.adapters)}
        spec = {
            "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "m"},
            "spec": {
                "model": {"source": "hf://org/base", "servedName": "m"},
                "adapters": [{"name": n, "source": f"file://{p}"} for n, p in adapters.items()],
                "engine": {"maxLoras": a.max_loras},
                "resources": {"gpu": {"count": 1}},
            },
        }  # fmt: skip
        spec_file = Path(self.tmp.name) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        for _ in range(a.replicas):
            port = free_port()
            process = self._spawn([
                sys.executable, "-m", "kubellm.engine", "--backend", "sim", "--port", str(port),
                "--spec", str(spec_file), "--profile", a.profile,
                "--time-scale", str(a.time_scale),
            ])  # fmt: skip
            self.engines.append(f"http://127.0.0.1:{port}")
            wait_healthy(self.engines[-1], process)
        static = Path(self.tmp.name) / "static.yaml"
        static.write_text(yaml.safe_dump({"models": [{
            "name": "m", "endpoints": self.engines,
            "routing": {"policy": a.policy, "loadBound": a.load_bound},
            "slo": {"ttftSeconds": a.ttft_slo * a.time_scale,
                    "itlSeconds": a.itl_slo * a.time_scale},
            "adapters": {n: f"file://{p}" for n, p in adapters.items()},
        }]}))  # fmt: skip
        port = free_port()
        process = self._spawn([
            sys.executable, "-m", "kubellm.gateway.cli", "--port", str(port),
            "--static", str(static), "--max-waiting", "1000000", "--max-kv-usage", "1.01",
            "--scrape-interval", "0.25", "--adapter-routing", self.routing,
        ])  # fmt: skip
        self.gateway = f"http://127.0.0.1:{port}"
        wait_healthy(self.gateway, process)
        return self


def lora_loads(urls: list[str]) -> list[float]:
    """Each replica's slot loads so far."""
    out = []
    for url in urls:
        text = httpx.get(f"{url}/metrics").text
        out.append(sum(s.value for family in text_string_to_metric_families(text)
                       for s in family.samples if s.name == SIM_LORA_LOADS))  # fmt: skip
    return out


async def one_request(client: httpx.AsyncClient, url: str, adapter: str, prompt: str,
                      max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """One streamed chat to `adapter`: TTFT and mean ITL (`bench._client`)."""
    body = {"model": adapter, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens}  # fmt: skip
    return await _client.stream(client, url, body)


async def drive(url: str, requests: list[tuple[str, str]], args: argparse.Namespace,
                seed: int) -> dict[str, Any]:  # fmt: skip
    """Open-loop Poisson arrivals at --rate requests per simulated second."""
    rng = random.Random(seed + 1)
    wall_rate = args.rate / args.time_scale
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=args.timeout * args.time_scale, limits=limits) as client:
        tasks = []
        start = time.monotonic()
        for adapter, prompt in requests:
            tasks.append(asyncio.create_task(
                one_request(client, url, adapter, prompt, args.max_tokens)))  # fmt: skip
            await asyncio.sleep(rng.expovariate(wall_rate))
        results = await asyncio.gather(*tasks)
        wall = time.monotonic() - start
    return {"results": results, "wall": wall}


def quantile(values: list[float], q: float) -> float | None:
    """The `q` quantile (0-1) as `kubellm.bench.stats.percentile` defines it (interpolated,
    numpy's default: the one definition of every figure the benchmarks print)."""
    return percentile(values, 100 * q)


def run_one(args: argparse.Namespace, routing: str, seed: int) -> dict[str, Any]:
    requests = workload(args, seed)
    with Fleet(args, routing) as fleet:
        before = lora_loads(fleet.engines)
        outcome = asyncio.run(drive(fleet.gateway, requests, args, seed))
        per_replica = [b - a for a, b in zip(before, lora_loads(fleet.engines), strict=True)]
        loads = sum(per_replica)
    s = args.time_scale
    ok = [r for r in outcome["results"] if r["ok"]]
    ttfts = [r["ttft"] / s for r in ok]
    good = sum(1 for r in ok if r["ttft"] / s <= args.ttft_slo and r["itl"] / s <= args.itl_slo)
    return {
        "routing": routing, "seed": seed, "requests": len(requests), "ok": len(ok),
        "rate_per_sim_s": args.rate, "loads_per_1000": 1000 * loads / len(requests),
        "loads_per_replica": per_replica,
        "ttft_p50": quantile(ttfts, 0.5), "ttft_p95": quantile(ttfts, 0.95),
        "goodput_rps": good / (outcome["wall"] / s), "slo_met_share": good / len(requests),
    }  # fmt: skip


def fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " " + __doc__.split(
        "\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--routing", default="affinity,blind", help="comma-separated")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=12)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of popularity")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per simulated s")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--policy", default="least-load")
    parser.add_argument("--load-bound", type=float, default=1.25, help="spec.routing.loadBound")
    parser.add_argument("--profile", default="llama-3.1-8b-h100")
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--ttft-slo", type=float, default=0.5, help="simulated seconds")
    parser.add_argument("--itl-slo", type=float, default=0.05, help="simulated seconds")
    parser.add_argument("--timeout", type=float, default=60.0, help="per request, simulated s")
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--out", default="bench/results/lora_routing.json")
    args = parser.parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C, so the fleet's processes are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    header = (f"{'routing':9} {'seed':>4} {'ok':>9} {'loads/1k':>9} {'ttft p50':>9} "
              f"{'ttft p95':>9} {'goodput/s':>10} {'slo met':>8}")  # fmt: skip
    print(
        f"{args.replicas} replicas x maxLoras {args.max_loras}, {args.adapters} adapters "
        f"(Zipf {args.zipf:g}), {args.requests} requests at {args.rate:g}/s, policy "
        f"{args.policy} (loadBound {args.load_bound:g}), SLO TTFT {args.ttft_slo:g} s "
        f"ITL {args.itl_slo:g} s (simulated s)"
    )
    bound = print_bound(args)
    print(header)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for routing in args.routing.split(","):
            row = run_one(args, routing, seed)
            rows.append(row)
            print(f"{routing:9} {seed:>4} {row['ok']:>4}/{row['requests']:<4} "
                  f"{fmt(row['loads_per_1000'], '.1f'):>9} {fmt(row['ttft_p50']):>9} "
                  f"{fmt(row['ttft_p95']):>9} {fmt(row['goodput_rps'], '.2f'):>10} "
                  f"{fmt(row['slo_met_share'], '.1%'):>8}", flush=True)  # fmt: skip
    by = {r: [x for x in rows if x["routing"] == r] for r in args.routing.split(",")}
    if "affinity" in by and "blind" in by:

        def mean(key: str, name: str) -> float:
            values = [x[key] for x in by[name] if x[key] is not None]
            return sum(values) / len(values) if values else float("nan")

        loads_a, loads_b = mean("loads_per_1000", "affinity"), mean("loads_per_1000", "blind")
        print(f"loads: blind / affinity = {loads_b / loads_a if loads_a else float('inf'):.1f}x "
              f"(target >= 5x; in expectation at most "
              f"{bound['blind'] / bound['ideal_bounded']:.1f}x within loadBound "
              f"{args.load_bound:g}, {bound['blind'] / bound['ideal_unbounded']:.1f}x with no "
              f"bound); TTFT p95 affinity {mean('ttft_p95', 'affinity'):.3f} s vs "
              f"blind {mean('ttft_p95', 'blind'):.3f} s")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "bound": bound, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
