"""Data-parallel ranks as endpoints against routing to the leader only (issue 43, simulated).

A DeepSeek-class MoE served wide: one replica of 16 data-parallel attention ranks
(profile `deepseek-v3-dp16-ep-2x8xh100`: each rank its own KV pool of ~275k tokens and
batch). Two ways to reach the ranks, on a simulated clock (bench/gateway/_slo/fleet.py: the
simulator's pure engine core per rank, the gateway's own Router and admission pass):

- `ranks` (what kubellm renders, contracts.dp_ranks_per_pod): every rank is an endpoint
  of its own (vLLM's external load balancing); the gateway routes with spec.routing's
  default policy (prefix-aware), so a prompt goes to the rank that holds its prefix;
- `leader`: the gateway sees one endpoint, the leader's API server, and vLLM's internal
  balancer picks the rank (vllm/v1/engine/core_client.py DPLBAsyncMPClient, 0.32: the
  lowest max(own in-flight, waiting + running) + waiting x 6 x max(0, KV use - 0.5),
  from the coordinator's snapshot every 100 ms, the scan start rotating): load-aware,
  blind to prefixes.

Workload `shared`: 400 documents or system prompts of 2-6k tokens (1.6M tokens: six
ranks' pools, a third of the replica's) with Zipf(1.0) popularity, each request one of
them plus a unique question of 50-150 tokens, answers of 50-300 tokens, Poisson arrivals.
Per case: prefix-cache hit rate (tokens hit / tokens queried, summed over the ranks'
engines), TTFT p50/p99, mean-ITL p99 and the share of requests meeting the SLO (TTFT 3 s,
ITL 0.1 s: the 405B example's). Figures are simulated seconds: independent of the load
of the machine running it.

    python -m bench.dp_rank_routing                      # rates 16, 32, 48 req/s, 60 s each
    python -m bench.dp_rank_routing --rates 32 --seconds 30 --ranks 8
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

from kubellm.engine import sim_profiles
from kubellm.gateway.routing.scorers.base import RoutingRequest

from bench.gateway._slo.fleet import CHARS_PER_TOKEN, Fleet, Job, Outcome
from kubellm import api
from kubellm.bench.stats import percentile

PROFILE = "deepseek-v3-dp16-ep-2x8xh100"
SLO = api.SLO(ttft_seconds=3.0, itl_seconds=0.1)
# vLLM's data-parallel coordinator publishes the engines' counts every 100 ms
COORDINATOR_INTERVAL = 0.1


class LeaderOnly(Fleet):
    """One endpoint in front of the ranks: vLLM's internal data-parallel balancer."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, scrape_interval=COORDINATOR_INTERVAL, **kwargs)  # type: ignore[misc]
        self.start = 0

    def choose(
        self, request: RoutingRequest, p: object = None, position: int = 1
    ) -> tuple[int, list]:
        # the signature of `Fleet.choose`; the leader admits at once (no pass, no wait)
        best, best_score = 0, math.inf
        n = len(self.replicas)
        for i in range(n):
            idx = (self.start + i) % n
            r = self.replicas[idx]
            running, waiting, kv = r.scraped or (0.0, 0.0, 0.0)
            score = max(self.outstanding[idx], waiting + running)
            if waiting:
                score += waiting * 6.0 * max(0.0, kv - 0.5)
            if score < best_score:
                best, best_score = idx, score
        self.start = (self.start + 1) % n
        return best, []


def shared_workload(rate: float, seconds: float, seed: int, documents: int = 400) -> list[Job]:
    rng = random.Random(seed)
    prefixes = [
        rng.randbytes(rng.randint(2000, 6000) * CHARS_PER_TOKEN // 2).hex()
        for _ in range(documents)
    ]
    weights = [1 / (k + 1) for k in range(documents)]  # Zipf(1.0)
    jobs, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            return jobs
        prefix = rng.choices(prefixes, weights)[0]
        question = f"{i}:" + rng.randbytes(rng.randint(50, 150) * CHARS_PER_TOKEN // 2).hex()
        jobs.append(Job(t, prefix + question, rng.randint(50, 300)))
        i += 1


def summarize(fleet: Fleet, outcomes: list[Outcome]) -> dict[str, float]:
    engines = [r.engine for r in fleet.replicas]
    queried = sum(e.prefix_queries for e in engines)
    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    itls = [o.mean_itl for o in outcomes if o.mean_itl is not None]
    good = sum(
        1
        for o in outcomes
        if o.ttft is not None
        and o.ttft <= SLO.ttft_seconds
        and (o.mean_itl is None or o.mean_itl <= SLO.itl_seconds)
    )
    counts = [0] * len(engines)
    for o in outcomes:
        counts[o.replica] += 1
    return {
        "hit": sum(e.prefix_hits for e in engines) / queried if queried else 0.0,
        "ttft50": percentile(ttfts, 50) or 0.0,
        "ttft99": percentile(ttfts, 99) or 0.0,
        "itl99": percentile(itls, 99) or 0.0,
        "slo": good / len(outcomes) if outcomes else 0.0,
        "spread": statistics.pstdev(counts) / statistics.mean(counts) if outcomes else 0.0,
        "done": sum(1 for o in outcomes if o.last is not None) / max(1, len(outcomes)),
    }


def run(mode: str, ranks: int, rate: float, seconds: float, seed: int) -> dict[str, float]:
    profiles = [sim_profiles.get(PROFILE)] * ranks
    jobs = shared_workload(rate, seconds, seed)
    policy = api.Routing().policy  # the shipped default
    fleet = (
        LeaderOnly(profiles, policy, SLO, seed=seed)
        if mode == "leader"
        else Fleet(profiles, policy, SLO, seed=seed)
    )
    return summarize(fleet, fleet.run(jobs).outcomes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="16,32,48", help="requests/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=60.0, help="simulated arrivals")
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"profile {PROFILE} x {args.ranks} ranks; workload shared (400 prefixes of 2-6k "
          f"tokens, Zipf 1.0); {args.seconds:g} simulated s per case; SLO TTFT "
          f"{SLO.ttft_seconds:g} s, ITL {SLO.itl_seconds:g} s; routing {api.Routing().policy} "
          "(the shipped default)")  # fmt: skip
    header = ("endpoints", "req/s", "prefix hit", "TTFT p50", "TTFT p99", "ITL p99", "in SLO",
              "load spread")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for rate in (float(r) for r in args.rates.split(",")):
        for mode in ("ranks", "leader"):
            s = run(mode, args.ranks, rate, args.seconds, args.seed)
            label = "each rank (kubellm)" if mode == "ranks" else "leader only (vLLM DP LB)"
            print(f"| {label} | {rate:g} | {s['hit']:.1%} | {s['ttft50']:.2f} s | "
                  f"{s['ttft99']:.2f} s | {s['itl99'] * 1000:.0f} ms | {s['slo']:.1%} | "
                  f"{s['spread']:.2f} |", flush=True)  # fmt: skip
    print("load spread: the coefficient of variation of requests per rank (0: even)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
