"""P/D disaggregation on the same GPUs: aggregated, always-split, conditional (kubellm's
`routing/disagg.decide`) and Dynamo's published rule (issue 41, Measure).

One run, simulated clock, no sleep (the simulation is `kubellm/simulation/pd.py`, which
`kubellm plan --trace --pd` runs too): each replica is the simulated engine's step physics
(`engine_image/sim_profiles.py`: a step costs base + prefill_token_s x prompt tokens +
decode_token_s x decoding sequences, at most max_num_batched_tokens prompt tokens a step,
chunked, at most max_num_seqs running, a KV pool of num_blocks x block_size tokens). A
split request's prompt runs on a prefill replica (one token), its KV moves to the decode
replica after bytes / link bandwidth (capacity.KV_LINK_GBPS, RDMA), and it decodes there
without computing the prompt. Decode routing: prefix holder first unless 1.25x past the
least load, else least load (the shipped prefix-aware rule's shape). The conditional
decision calls the real `disagg.decide` at the shipped margin (`PrefillSplit.margin`) with
predictions carrying the latency model's error (`--error`, the sigma of a seeded lognormal
factor per replica and request, `pd.ERRORS`; the engines run the true costs), each table
with the exact-state rows (error 0) beside; `--sweep` sweeps the margin against the error.
Gamma arrivals (burstiness 0.5: shape 0.5, CV sqrt 2).

Goodput as DistServe defines it: the highest rate at which >= 90% of requests meet both
the TTFT and the mean-ITL target (bisection over the rate). Run:
`.venv/bin/python -m bench.pd_disagg [--quick]`; the margin against the error:
`--pools 70B/4xH100 --requests 1200 --sweep` (`--prefill 1` for one P:D, `--margins`);
the local side's cost against what a long prompt's stall does to the streams beside it:
`--pools 70B/4xH100 --harm rag:2.1,mix:3.9`; several workload samples pooled per point (the
more precise figure; each sample's beside): `--seeds 0,1,2 --prefill 3 [--bisections 8]`;
conditional's misses by kind at a rate: `--prefill 5 --seeds 0,1,2 --misses rag:19.5`.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kubellm.engine.sim_profiles import PROFILES
from kubellm.gateway.discovery.base import PrefillSplit
from kubellm.gateway.routing.disagg import plan
from kubellm.gateway.routing.latency.predictions import CHARS_PER_TOKEN, Predictions
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest

from kubellm import capacity
from kubellm.simulation.pd import ERRORS, LINK, Job, Pool, Replica, Req, Sim, attained, sweep
from kubellm.simulation.pd import bound as pool_bound
from kubellm.simulation.pd import goodput as pool_goodput

BURSTINESS = 0.5  # gamma shape (1: Poisson)
POOLS = {  # name: (profile, GPUs per replica, replicas of the same GPU count, KV bytes/token)
    "8B/H100": Pool("llama-3.1-8b-h100", 1, 8, capacity.kv_bytes_per_token(32, 8, 128, 2)),
    "70B/4xH100": Pool("llama-3.1-70b-4xh100", 4, 4, capacity.kv_bytes_per_token(80, 8, 128, 2)),
}
SECONDS = 40.0  # of arrivals at least, per point
MAX_REQUESTS = 6000


# ---------------------------------------------------------------- workloads


def lognormal(rng: random.Random, median: float, low: int, high: int, sigma: float = 0.6) -> int:
    return int(min(high, max(low, rng.lognormvariate(math.log(median), sigma))))


def workload(name: str, rate: float, count: int, seed: int = 0) -> list[Req]:
    """Long-prompt RAG/agent (4-16k prompts, 100-500 answers, a third on 8 shared 4k
    prefixes), production chat (Azure 2023 conversation lengths: median prompt 1,020 and
    answer 129 tokens, Splitwise, Patel et al. 2024), or a half-half mix; gamma arrivals."""
    rng = random.Random(f"{name}/{seed}")
    out, t = [], 0.0
    for _ in range(count):
        t += rng.gammavariate(BURSTINESS, 1.0 / (rate * BURSTINESS))
        kind = name if name != "mix" else rng.choice(("rag", "chat"))
        if kind == "rag":
            prompt, output = rng.randint(4096, 16384), rng.randint(100, 500)
            if rng.random() < 1 / 3:
                out.append(Req(t, prompt, output, rng.randrange(8), 4096))
                continue
            out.append(Req(t, prompt, output))
        else:
            out.append(Req(t, lognormal(rng, 1020, 16, 8000), lognormal(rng, 129, 4, 1024)))
    return out


# ---------------------------------------------------------------- replicas


def requests_at(wl: str, n: int, seed: int = 0) -> Callable[[float], list[Req]]:
    """`n` requests, or `SECONDS` of arrivals at the rate where that is more (a short run at
    a high rate ends before the queues it builds show: 500 chat requests at 150/s are 3 s);
    `seed`: the workload's sample."""
    return lambda rate: workload(wl, rate, min(MAX_REQUESTS, max(n, int(rate * SECONDS))), seed)


def run(
    pool: str, shape: str, prefill: int, wl: str, rate: float, n: int, slo, **errs: float
) -> Sim:
    sim = Sim(POOLS[pool], shape, prefill, requests_at(wl, n)(rate), slo, **errs)
    sim.run()
    return sim


def goodput(
    pool: str,
    shape: str,
    prefill: int,
    wl: str,
    n: int,
    slo,
    hi: float,
    seeds: tuple[int, ...] = (0,),
    bisections: int = 6,
    **errs: float,
) -> float:
    """The highest rate (req/s) with >= 90% of requests within both SLOs (bisection);
    `errs`: the decision's margin and the predictions' error (`Sim`'s); `seeds`: the
    workload samples pooled at each rate (`pd.goodput`; seed s's predictions' error drawn
    with seed s too)."""
    samples = {s: requests_at(wl, n, s) for s in seeds}
    return pool_goodput(samples, POOLS[pool], shape, prefill, slo, hi, bisections, **errs)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bound(pool: str, wl: str) -> float:
    """The fleet's compute bound (req/s) on the workload's sizes (`pd.bound`)."""
    return pool_bound(POOLS[pool], workload(wl, 1.0, 2000))


SLO = (2.0, 0.030)  # TTFT 2 s, mean ITL 30 ms
WORKLOADS = ("rag", "chat", "mix")
SWEEP_MARGINS = (0.0, 0.05, 0.1, 0.2, 0.3)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    ap.add_argument("--decision-cost", action="store_true", help="only the decision's cost")
    ap.add_argument("--pools", default=",".join(POOLS), help="of " + ", ".join(POOLS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="of " + ", ".join(WORKLOADS))
    ap.add_argument("--requests", type=int, default=300,
                    help="requests per point at least (or 40 s of arrivals, the more): at 300 a "
                    "point's share within the SLOs is +-1.7 points (binomial), which moves a "
                    "low-rate pool's goodput by a bisection step or two")  # fmt: skip
    ap.add_argument(
        "--margin",
        type=float,
        default=PrefillSplit.margin,
        help="conditional's margin (default: the shipped PrefillSplit.margin)",
    )
    ap.add_argument(
        "--error",
        type=float,
        default=ERRORS["realistic"],
        help="the predictions' error: sigma of the log of a per-replica, per-request factor "
        f"(0: exact state; default: the latency model's measured; {ERRORS})",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help=f"conditional's goodput for margins {SWEEP_MARGINS} x errors "
        f"{tuple(ERRORS.values())}, each at its best P:D",
    )
    ap.add_argument(
        "--prefill",
        help="prefill replica counts to try, comma-separated (default: every P:D, pd.sweep)",
    )
    ap.add_argument(
        "--harm",
        metavar="WORKLOAD:RATE,...",
        help="measure the cost against the harm: each long prompt conditional keeps local "
        "beside decoding streams, what its cost read (their mean ITL) and what its stall "
        "did to them, at the first --prefill count (default 3) and these rates (req/s)",
    )
    ap.add_argument(
        "--misses",
        metavar="WORKLOAD:RATE,...",
        help="conditional's misses by kind (local or split; TTFT, ITL or both) and its "
        "reasons at these rates, at the first --prefill count (default 3), --seeds pooled",
    )
    ap.add_argument(
        "--seeds",
        help="workload samples to pool, comma-separated (e.g. 0,1,2): each point's share "
        "within both SLOs over every sample's requests together, each shape at its best "
        "pooled P:D, the per-sample goodputs beside (default: one sample, seed 0, the full "
        "table)",
    )
    ap.add_argument(
        "--bisections",
        type=int,
        default=6,
        help="--seeds: bisection steps over [0, compute bound] (6: a step of 1.6%% of the "
        "bound, 0.07 req/s on 70B RAG; 8: 0.4%%)",
    )
    ap.add_argument(
        "--margins",
        default=",".join(f"{m:g}" for m in SWEEP_MARGINS),
        help="--sweep: the margins",
    )
    return ap


def ratios(pool: str, prefill: str | None) -> list[int]:
    return [int(k) for k in prefill.split(",")] if prefill else sweep(POOLS[pool].replicas)


def main() -> None:
    args = parser().parse_args()
    if args.decision_cost:
        decision_cost()
        return
    if args.harm:
        harm(args.pools.split(",")[0], int((args.prefill or "3").split(",")[0]), args.harm)
        return
    n = 150 if args.quick else args.requests
    if args.misses:
        seeds = tuple(int(s) for s in (args.seeds or "0").split(","))
        prefill = int((args.prefill or "3").split(",")[0])
        misses(args.pools.split(",")[0], prefill, args.misses, n, seeds, args.error)
        return
    pools, workloads = args.pools.split(","), args.workloads.split(",")
    print(f"# P/D on the same GPUs; {n} requests or {SECONDS:g} s of arrivals per point (the"
          f" more), gamma arrivals (shape {BURSTINESS}),"
          f" KV link {LINK / 1e9:g} GB/s (RDMA); SLO TTFT 2 s, mean ITL 30 ms; goodput = the"
          " highest rate with 90% within both")  # fmt: skip
    if args.sweep:
        margin_sweep(pools, workloads, n, args.prefill, args.margins)
        return
    if args.seeds:
        seeds = tuple(int(s) for s in args.seeds.split(","))
        pooled(pools, workloads, n, args.prefill, seeds, args.margin, args.error, args.bisections)
        return
    errs = {"margin": args.margin, "error": args.error}
    exact = {"margin": args.margin, "error": 0.0}
    print(f"# conditional's margin {args.margin:g}, the predictions' error sigma {args.error:g}"
          " (rows 'exact': error 0)")  # fmt: skip
    for pool, spec in ((p, POOLS[p]) for p in pools):
        name, gpus, replicas = spec.profile, spec.gpus, spec.replicas
        print(f"\n## {pool}: {replicas} replicas x {gpus} GPU ({name})")
        for wl in workloads:
            hi = cap = bound(pool, wl)
            rows = [("aggregated", 0, errs)]
            for shape, e in (("always", errs), ("conditional", errs), ("dynamo", errs),
                             ("conditional", exact)):  # fmt: skip
                best = max(ratios(pool, args.prefill), key=lambda k, s=shape, e=e: goodput(
                    pool, s, k, wl, n, SLO, hi, **e))  # fmt: skip
                rows.append((shape, best, e))
            print(f"\n### {wl}: compute bound {cap:.1f} req/s (every GPU busy, no SLO)")
            print("| shape | P:D | goodput req/s | SLO-met req/s at 1.3x agg knee | TTFT p50 | "
                  "TTFT p99 | ITL p99 beside a >=2k-token prefill (else all) | split share |"
                  " reasons |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|")
            knee = None
            for shape, k, e in rows:
                g = goodput(pool, shape, k, wl, n, SLO, hi, **e)
                knee = knee or g
                sim = run(pool, shape, k, wl, max(knee * 1.3, 0.1), n, SLO, **e)
                met = attained(sim.jobs, SLO) * max(knee * 1.3, 0.1)
                at = run(pool, shape, k, wl, max(g, 0.05), n, SLO, **e)
                ttfts = [j.first - j.req.t for j in at.jobs]
                split = sum(j.split for j in at.jobs) / len(at.jobs)
                reasons = ", ".join(f"{r} {c}" for r, c in sorted(at.reasons.items()))
                pd = "-" if shape == "aggregated" else f"{k}:{replicas - k}"
                label = shape + (", exact" if e is exact else "")
                print(f"| {label} | {pd} | {g:.2f} | {met:.2f} | {pct(ttfts, .5):.2f} | "
                      f"{pct(ttfts, .99):.2f} | {1e3 * pct(at.harmed or at.gaps, .99):.0f} ms |"
                      f" {split:.0%} | {reasons} |", flush=True)  # fmt: skip
    decision_cost()


def pooled(
    pools: list[str],
    workloads: list[str],
    n: int,
    prefill: str | None,
    seeds: tuple[int, ...],
    margin: float,
    error: float,
    bisections: int = 6,
) -> None:
    """Each shape's goodput on the workload samples `seeds` pooled (`pd.goodput`), at its
    best pooled P:D, with each sample's own goodput at that P:D beside, and the share of
    requests split at the pooled goodput (over every sample's requests)."""
    errs = {"margin": margin, "error": error}
    exact = {"margin": margin, "error": 0.0}
    print(f"# {len(seeds)} workload samples pooled per point (seeds {seeds}); conditional's "
          f"margin {margin:g}, error sigma {error:g} (row 'exact': 0)")  # fmt: skip
    for pool in pools:
        replicas = POOLS[pool].replicas
        print(f"\n## {pool}: goodput req/s, pooled and per sample")
        print("| workload | shape | P:D | pooled | " + " | ".join(f"seed {s}" for s in seeds)
              + " | split share (pooled, at its goodput) |")  # fmt: skip
        print("|---|---|---|---|" + "---|" * len(seeds) + "---|")
        for wl in workloads:
            hi = bound(pool, wl)
            rows = (("aggregated", errs), ("always", errs), ("conditional", errs),
                    ("dynamo", errs), ("conditional", exact))  # fmt: skip
            for shape, e in rows:
                ks = [0] if shape == "aggregated" else ratios(pool, prefill)
                g = {k: goodput(pool, shape, k, wl, n, SLO, hi, seeds, bisections, **e)
                     for k in ks}  # fmt: skip
                k = max(g, key=lambda k: (g[k], -k))
                each = [goodput(pool, shape, k, wl, n, SLO, hi, (s,), bisections, **e)
                        for s in seeds]  # fmt: skip
                jobs = [j for s in seeds for j in Sim(
                    POOLS[pool], shape, k, requests_at(wl, n, s)(max(g[k], 0.05)), SLO,
                    seed=s, **e).run()]  # fmt: skip
                split = sum(j.split for j in jobs) / len(jobs)
                pd = "-" if shape == "aggregated" else f"{k}:{replicas - k}"
                label = shape + (", exact" if e is exact else "")
                print(f"| {wl} | {label} | {pd} | {g[k]:.2f} | "
                      + " | ".join(f"{x:.2f}" for x in each) + f" | {split:.0%} |",
                      flush=True)  # fmt: skip


def margin_sweep(
    pools: list[str], workloads: list[str], n: int, prefill: str | None, margins: str
) -> None:
    """Conditional's goodput per margin and prediction error, each at its best P:D, and
    aggregated's beside (the margin to ship: the best under realistic error that is never
    under aggregated)."""
    for pool in pools:
        replicas = POOLS[pool].replicas
        print(f"\n## {pool}: conditional's goodput req/s (P:D)")
        print("| workload | aggregated | margin | " + " | ".join(
            f"error {k} ({v:g})" for k, v in ERRORS.items()) + " |")  # fmt: skip
        print("|---|---|---|" + "---|" * len(ERRORS))
        for wl in workloads:
            hi = bound(pool, wl)
            agg = goodput(pool, "aggregated", 0, wl, n, SLO, hi)
            for m in (float(m) for m in margins.split(",")):
                cells = []
                for e in ERRORS.values():
                    g = {k: goodput(pool, "conditional", k, wl, n, SLO, hi, margin=m, error=e)
                         for k in ratios(pool, prefill)}  # fmt: skip
                    k = max(g, key=lambda k: (g[k], -k))
                    cells.append(f"{g[k]:.2f} ({k}:{replicas - k})")
                print(f"| {wl} | {agg:.2f} | {m:g} | " + " | ".join(cells) + " |", flush=True)


def harm(pool: str, prefill: int, at: str, n: int = 1200) -> None:
    """Per long prompt (>= 2,048 uncached tokens) conditional keeps local beside decoding
    streams: the streams' ITL the decision's cost read (`Verdict.local_itl_harm`, its
    prediction), the mean ITL they realised, this prompt's stall (its uncached tokens' compute)
    over each one's answer, and how many of them missed the ITL target, and missed it only
    by this stall (their mean ITL less the stall's share within it). Realistic error and
    exact state."""
    spec = POOLS[pool]
    p = PROFILES[spec.profile]
    print(f"\n## {pool} at {prefill}:{spec.replicas - prefill}, {n} requests: long prompts kept"
          " local beside decoding streams (means per prompt)")  # fmt: skip
    print("| workload | req/s | error | within both SLOs | misses: ITL of split streams |"
          " kept local | stall s | streams there | ITL the cost read ms | realised ITL ms |"
          " stall / answer ms | streams missing ITL | ... only by this stall |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for item in at.split(","):
        wl, rate = item.split(":")
        for name in ("realistic", "exact"):
            sim = Sim(spec, "conditional", prefill, requests_at(wl, n)(float(rate)), SLO,
                      error=ERRORS[name])  # fmt: skip
            sim.record = True
            sim.run()
            jobs = {j.index: j for j in sim.jobs}

            def itl(j: Job) -> float:
                return (j.last - j.first) / max(j.req.output - 1, 1)

            def ok(j: Job) -> bool:
                return j.first - j.req.t <= SLO[0] and itl(j) <= SLO[1] and j.left <= 0

            split_itl = sum(j.split and not ok(j) and itl(j) > SLO[1] for j in sim.jobs)
            rows = []
            for _, x, v, there in sim.verdicts:
                if v.split or x.uncached_tokens < 2048 or not there:
                    continue
                stall = x.uncached_tokens * p.prefill_token_s
                share = [stall / max(jobs[k].req.output - 1, 1) for k in there]
                itls = [itl(jobs[k]) for k in there]
                only = sum(i > SLO[1] >= i - s for i, s in zip(itls, share, strict=True))
                missed = sum(i > SLO[1] for i in itls)
                rows.append((stall, len(there), v.local_itl_harm, statistics.mean(itls),
                             statistics.mean(share), missed, only))  # fmt: skip
            misses = sum(not ok(j) for j in sim.jobs)
            cells = [statistics.mean(r[k] for r in rows) if rows else 0.0 for k in range(7)]
            print(f"| {wl} | {rate} | {name} | {attained(sim.jobs, SLO):.1%} | {split_itl} of "
                  f"{misses} | {len(rows)} | {cells[0]:.2f} | {cells[1]:.1f} | "
                  f"{1e3 * cells[2]:.1f} | {1e3 * cells[3]:.1f} | {1e3 * cells[4]:.1f} | "
                  f"{cells[5]:.1f} | {cells[6]:.1f} |", flush=True)  # fmt: skip


def misses(pool: str, prefill: int, at: str, n: int, seeds: tuple[int, ...], error: float) -> None:
    """Conditional's requests by where their prompt ran and which SLO they missed, and its
    decisions' reasons, over the samples `seeds` together at each rate."""
    print(f"\n## {pool} at {prefill}:{POOLS[pool].replicas - prefill}, conditional, error "
          f"{error:g}, seeds {seeds} pooled, {n} requests each")  # fmt: skip
    for item in at.split(","):
        wl, rate = item.split(":")
        jobs: list[Job] = []
        reasons: dict[str, int] = {}
        for s in seeds:
            sim = Sim(POOLS[pool], "conditional", prefill, requests_at(wl, n, s)(float(rate)),
                      SLO, error=error, seed=s)  # fmt: skip
            jobs += sim.run()
            for r, c in sim.reasons.items():
                reasons[r] = reasons.get(r, 0) + c
        kinds: dict[str, int] = {}
        for j in jobs:
            late = j.first - j.req.t > SLO[0]
            slow = (j.last - j.first) / max(j.req.output - 1, 1) > SLO[1]
            kind = ("split" if j.split else "local") + (" TTFT" if late else "") + (
                " ITL" if slow else "")  # fmt: skip
            kinds[kind] = kinds.get(kind, 0) + 1
        print(f"{wl} at {rate} req/s: within both {attained(jobs, SLO):.1%} of {len(jobs)}; "
              + ", ".join(f"{k} {c}" for k, c in sorted(kinds.items()))
              + "; reasons " + ", ".join(f"{r} {c}" for r, c in sorted(reasons.items())),
              flush=True)  # fmt: skip


def decision_cost() -> None:
    """The decision's cost at 16 prefill + 16 decode replicas: Python bytecodes executed
    (the same on any machine at any load) and the thread's CPU time (no time spent
    descheduled counts; the load is printed beside it)."""
    sim = Sim(POOLS["8B/H100"], "conditional", 1, [], (2.0, 0.03))
    sim.replicas = [Replica("prefill", sim.p) for _ in range(16)] + [
        Replica("decode", sim.p) for _ in range(16)]  # fmt: skip
    sim.decoders, sim.prefillers = list(range(16, 32)), list(range(16))
    codes, cpu = [], []
    for i, req in enumerate(workload("mix", 1.0, 2000)):

        def once(req: Req = req) -> None:
            sim.split(sim.pick_decode(req), req)

        started = time.thread_time()
        once()
        cpu.append(time.thread_time() - started)
        codes.append(bytecodes(once))
        sim.replicas[i % 32].queued_tokens = (i * 977) % 20000
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    print(f"\ndecision cost at 16 prefill + 16 decode replicas (pick decode + decide, 2,000 "
          f"requests): p50 {pct(codes, .5):,.0f}, p99 {pct(codes, .99):,.0f} Python bytecodes "
          f"(a C builtin call counts one); thread CPU time p50 {1e6 * pct(cpu, .5):.0f} us, p99 "
          f"{1e6 * pct(cpu, .99):.0f} us (load {load})")  # fmt: skip
    # the gateway's own decision for a chosen decode replica: the latency model's TTFT on
    # each of 16 prefill replicas, then decide (routing/disagg.plan)
    predictions = Predictions()
    prefills = [Candidate(f"http://p{i}", in_flight=i % 4, running=float(i % 4),
                          waiting=float(i % 3)) for i in range(16)]  # fmt: skip
    codes, cpu = [], []
    for i, req in enumerate(workload("mix", 1.0, 2000)):
        decode = Candidate(f"http://d{i % 16}", in_flight=i % 40, running=float(i % 40))
        request = RoutingRequest("m", prompt_chars=req.prompt * CHARS_PER_TOKEN)

        def gateway(request: RoutingRequest = request, decode: Candidate = decode) -> None:
            plan(predictions, request, decode, prefills, PrefillSplit(), 2.0, 0.03)

        started = time.thread_time()
        gateway()
        cpu.append(time.thread_time() - started)
        codes.append(bytecodes(gateway))
        predictions.prefill_rate(decode.url, add=req.prompt)
    print(f"the gateway's disagg.plan at 16 prefill replicas: p50 {pct(codes, .5):,.0f}, p99 "
          f"{pct(codes, .99):,.0f} Python bytecodes; thread CPU time p50 "
          f"{1e6 * pct(cpu, .5):.0f} us, p99 {1e6 * pct(cpu, .99):.0f} us")  # fmt: skip


def bytecodes(call: Callable[[], None]) -> int:
    """The Python bytecodes `call` executes (sys.settrace's opcode events)."""
    count = 0

    def trace(frame, event, _arg):  # type: ignore[no-untyped-def]
        nonlocal count
        frame.f_trace_opcodes = True
        count += event == "opcode"
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


if __name__ == "__main__":
    main()
