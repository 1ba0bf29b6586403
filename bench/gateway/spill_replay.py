"""Where the pressure workload's prefix hits go: an offline replay, no engines, no timing.

The `pressure` workload of bench/gateway/routing.py (64 tenants' 1.5-2.5k-token prefixes,
Zipf popularity, a short unique question each) replayed against four LRU caches of
--blocks blocks each (the simulator's block hashes, 16 tokens a block; each answer's own
blocks cached too), with Poisson arrivals at --rate per simulated second and every request
holding its replica for --service seconds plus its prefill (--prefill-tps tokens/s), so the
bounded-load filter sees in-flight counts like the gateway's. Routing is the gateway's
prefix-aware rule reduced to its parts: the bounded-load filter (capacity =
ceil(bound x (total + 1) / replicas)), then prefix match 4, the prompt's rendezvous home 2,
lightness 0.5. Rows:

- `home, bound B`: the match is what the replica really holds (precise knowledge) with the
  plain bound; `no bound`: the same with the filter off;
- `precise/approximate, holders x2`: the bound widened to 2 x B for replicas holding at
  least half of the prompt, by the replica's real cache (precise) or by what was sent
  there (approximate).

It is a model, not a measurement of the gateway: it has no event lag, no scrape lag and no
engine batching. It explains the measured figures (docs/operations.md, "Choosing a routing
policy"): the load bound's spills, not stale knowledge, are what cost hits under pressure.

    python -m bench.spill_replay
    python -m bench.spill_replay --seeds 7,11,13 --requests 240
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Container

from bench.gateway.routing import BLOCK, ideal_hit_rate, tenant_workload
from kubellm import kv_blocks
from kubellm.sim_text import ApproxTokens, render_chat


def rendezvous(key: str, replica: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}/{replica}".encode(), digest_size=8).digest())


def matched(hashes: list[bytes], held: Container[object]) -> int:
    """How many of the prompt's blocks, from the first, `held` has."""
    count = 0
    for h in hashes:
        if h not in held:
            break
        count += 1
    return count


def replay(
    prompts: list[list[dict[str, str]]],
    args: argparse.Namespace,
    bound: float,
    holder_slack: float,
    knows: str,
) -> float:
    """Hit rate (tokens hit / tokens queried) of one routing rule; `knows` is "cache" (what
    each replica holds) or "sent" (what was sent there, never forgotten)."""
    tokens, hasher = ApproxTokens(), kv_blocks.BlockHasher(BLOCK)
    n = args.replicas
    caches: list[OrderedDict[object, None]] = [OrderedDict() for _ in range(n)]
    sent: list[set[bytes]] = [set() for _ in range(n)]
    rng = random.Random(1)
    now, ends, load = 0.0, [], [0] * n
    hits = queries = 0
    for messages in prompts:
        now += rng.expovariate(args.rate)
        while ends and ends[0][0] <= now:
            load[heapq.heappop(ends)[1]] -= 1
        ids = tokens.encode(render_chat(messages))
        hashes = hasher.raw(ids[:-1], max_blocks=1 << 30)
        key = messages[0]["content"][:40]

        known = caches if knows == "cache" else sent
        belief = [matched(hashes, known[r]) for r in range(n)]
        cap = math.ceil(bound * (sum(load) + 1) / n)
        wide = math.ceil(bound * holder_slack * (sum(load) + 1) / n)
        ok = [r for r in range(n) if load[r] + 1 <= cap] or [min(range(n), key=load.__getitem__)]
        ok += [r for r in range(n) if r not in ok and load[r] + 1 <= wide
               and belief[r] >= 0.5 * len(hashes)]  # fmt: skip
        home = max(ok, key=lambda r: rendezvous(key, r))
        top = max(1, max(load))
        chosen = max(ok, key=lambda r: 4 * belief[r] / len(hashes) + 2 * (r == home)
                     + 0.5 * (1 - load[r] / top))  # fmt: skip
        hit = matched(hashes, caches[chosen])
        hits += hit * BLOCK
        queries += len(ids)
        cache = caches[chosen]
        for h in hashes:
            cache.pop(h, None)
            cache[h] = None
        sent[chosen].update(hashes)
        for k in range(3):  # the question's tail and the answer: blocks nobody reuses
            cache[(now, k)] = None
        while len(cache) > args.blocks:
            cache.popitem(last=False)
        load[chosen] += 1
        prefill = (len(hashes) - hit) * BLOCK / args.prefill_tps
        heapq.heappush(ends, (now + args.service + prefill, chosen))
    return hits / queries if queries else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="7,11,13")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--blocks", type=int, default=1000, help="KV blocks per replica")
    p.add_argument("--rate", type=float, default=12.0, help="arrivals per simulated second")
    p.add_argument("--service", type=float, default=0.25, help="seconds a request is held")
    p.add_argument("--prefill-tps", type=float, default=20_000.0)
    p.add_argument("--bound", type=float, default=1.25)
    args = p.parse_args(argv)
    rules = [
        ("home, bound", args.bound, 1.0, "cache"),
        ("home, no bound", 1e9, 1.0, "cache"),
        ("precise, holders x2", args.bound, 2.0, "cache"),
        ("approximate, holders x2", args.bound, 2.0, "sent"),
    ]
    print(f"{'seed':>5} {'ideal':>6} {'pool LRU':>8} " + " ".join(f"{r[0]:>24}" for r in rules))
    for seed in (int(s) for s in args.seeds.split(",")):
        prompts = tenant_workload("pressure", args.requests, seed)
        pooled = ideal_hit_rate(prompts, args.blocks * args.replicas)
        figures = [replay(prompts, args, bound, slack, knows) for _, bound, slack, knows in rules]
        print(f"{seed:>5} {ideal_hit_rate(prompts):>6.1%} {pooled:>8.1%} "
              + " ".join(f"{f:>24.1%}" for f in figures), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
