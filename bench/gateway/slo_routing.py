"""Routing by predicted latency (spec.routing.policy slo-aware) against the other policies.

One discrete-event simulation per (pool, policy, rate), on a simulated clock
(bench/gateway/_slo/fleet.py): replicas are the simulator's pure core with the named profiles,
kubellm's policies are the gateway's own Router and Predictions, vllm-router's
`power_of_two` and `cache_aware` are modelled on their published algorithms (the live
Rust router is bench/gateway/routing.py's `vllm-router:POLICY`).

Workload (bench/gateway/_slo/fleet.py `workload`): prompts heavy-tailed 50-8,000 tokens
(lognormal, median 600), answers 20-800 (median 150), gamma arrivals with burstiness
0.5, a third of the requests after one of 4 shared system prompts of 1-2k tokens.
Pools: `h100` = 4 x llama-3.1-8b-h100; `mixed` = 2 x H100 + 2 x llama-3.1-8b-a100;
`slow` = 3 x H100 + one H100 slowed 1.5x. Not tuned on (added 2026-12-03 for issue #38):
`2fast2slow` = 2 x H100 + 2 x H100 slowed 1.5x, each at `maxNumSeqs` 16, under the
`production` workload (prompts median 1,000, answers median 400 up to 2,000 tokens): its
knee is 5-10 req/s, where a replica's 16 slots, not its steps, bound it. `--non-streamed`
runs the requests as the gateway sees non-streamed ones (no first token: nothing learnt).
Not tuned on either (added 2026-12-03, issue #38's second round): `1fast3slow2x` (one H100
and three 2x slower, 16 slots each, `production`) and `3fast1slow3x` (three H100 and one
3x slower, 32 slots each, under `rag`: prompts median 3,000 tokens, answers median 100);
the `chat` workload (prompts median 300, answers median 600) for `--workload`.
`--thresholds gateway` runs kubellm's policies behind the gateway's default saturation
thresholds (a request waits in the gateway while every replica is saturated, and is
refused once its TTFT budget is spent); the default, none, sends every request at once.

Each case is 60 simulated seconds of arrivals (`--seconds`): long enough for the fleet to
reach its steady state (answers last up to ~20 s at the knee). The runs of 1,200 requests
used before (`--requests 1200`, 8-20 s at these rates) measured mostly the fleet filling
from empty: every policy's 90%-rate came out above the pool's steady-state bound.

Per case: goodput (share of requests meeting both SLO targets, and requests/s meeting
them), TTFT p50/p99, mean-ITL p99, the predictor's TTFT and ITL MAPE (every policy's
dispatches are predicted, learning from its answers), and for slo-aware the decision
cost (p99 CPU time of one routing decision, 4 replicas here and 16 in a separate
measurement). Then the 90%-rate per policy (DistServe's goodput: the highest rate of
the sweep at which 90% of requests meet both SLOs, linearly interpolated) and the
verdict against issue #30's targets.

    python -m bench.slo_routing                          # every pool's sweep (minutes)
    python -m bench.slo_routing --quick                  # every other rate, 10 s each
    python -m bench.slo_routing --pools mixed --rates 30,45,60 --requests 1200
    python -m bench.slo_routing --pools h100 --rates 80 --policies slo-aware --floor
    python -m bench.slo_routing --pools 2fast2slow --seconds 120 [--non-streamed]
    python -m bench.slo_routing --pools 1fast3slow2x,3fast1slow3x [--thresholds gateway]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from pathlib import Path

from kubellm.engine import sim_profiles
from kubellm.gateway.routing.latency.predictions import Predictions
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.settings import Thresholds

from bench.gateway._slo.fleet import (
    CHARS_PER_TOKEN,
    KUBELLM_POLICIES,
    PEER_POLICIES,
    Fleet,
    Job,
    Outcome,
    workload,
)
from kubellm import api
from kubellm.bench.stats import percentile
from kubellm.simulation.gateway import NEVER_SATURATED

H100 = sim_profiles.get("llama-3.1-8b-h100")
A100 = sim_profiles.get("llama-3.1-8b-a100")
POOLS = {
    "h100": [H100] * 4,
    "mixed": [H100, H100, A100, A100],
    "slow": [H100, H100, H100, H100.slowed(1.5)],
    "2fast2slow": [H100.with_overrides(max_num_seqs=16)] * 2
    + [H100.with_overrides(max_num_seqs=16).slowed(1.5)] * 2,
    # not tuned on (2026-12-03, issue #38's second round): other ratios, other limits
    "1fast3slow2x": [H100.with_overrides(max_num_seqs=16)]
    + [H100.with_overrides(max_num_seqs=16).slowed(2.0)] * 3,
    "3fast1slow3x": [H100.with_overrides(max_num_seqs=32)] * 3
    + [H100.with_overrides(max_num_seqs=32).slowed(3.0)],
}
# Workloads (bench/gateway/_slo/fleet.py `workload`'s knobs) and each pool's own.
WORKLOADS: dict[str, dict[str, int]] = {
    "default": {},
    "production": {"prompt_median": 1000, "answer_median": 400, "answer_max": 2000},
    # not tuned on (2026-12-03): long documents with short answers, chat with long answers
    "rag": {"prompt_median": 3000, "answer_median": 100, "answer_max": 500},
    "chat": {"prompt_median": 300, "answer_median": 600, "answer_max": 2000},
}
POOL_WORKLOAD = {"2fast2slow": "production", "1fast3slow2x": "production", "3fast1slow3x": "rag"}
# Each pool's sweep: from under every policy's knee to past 1.4x prefix-aware's 90%-rate.
# Each pool's knee lies near its steady-state capacity bound (`capacity`): 85 / 58 / 77
# req/s. (The sweeps of the runs of 1,200 requests, before 2026-12-02's runs of 60 s:
# h100 60,80,100,120,150; mixed 20,30,40,50,60,70; slow 60,70,85,100,115,130.)
RATES = {
    "h100": [60.0, 70.0, 75.0, 80.0, 85.0, 90.0, 100.0, 115.0],
    "mixed": [30.0, 35.0, 40.0, 45.0, 50.0, 55.0, 60.0],
    "slow": [50.0, 55.0, 60.0, 65.0, 70.0, 75.0, 80.0, 95.0],
    "2fast2slow": [3.0, 5.0, 7.0, 9.0, 11.0],
    "1fast3slow2x": [2.0, 4.0, 6.0, 8.0],
    "3fast1slow3x": [10.0, 15.0, 20.0, 25.0],
}
POLICIES = ["prefix-aware", "least-load", "slo-aware", "power_of_two", "cache_aware"]
SLO = api.SLO(ttftSeconds=1.0, itlSeconds=0.05)


def summarize(outcomes: list[Outcome], rate: float, duration: float) -> dict[str, float]:
    done = [o for o in outcomes if o.first is not None]
    met = [o for o in done if o.ttft <= SLO.ttft_seconds and (o.mean_itl or 0) <= SLO.itl_seconds]
    ttfts = [o.ttft for o in done]
    itls = [o.mean_itl for o in done if o.mean_itl is not None]
    warm = done[len(done) // 5 :]  # the predictor's error once it has seen answers

    def mape(pairs: list[tuple[float, float]]) -> float:
        return statistics.fmean(abs(p - y) / y for p, y in pairs if y > 0) if pairs else 0.0

    return {
        "rate": rate,
        "slo_share": len(met) / len(outcomes),
        "goodput_rps": len(met) / duration,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "itl_p99": percentile(itls, 99),
        "ttft_mape": mape([(o.predicted_ttft, o.first - o.sent) for o in warm]),
        "itl_mape": mape([(o.predicted_itl, o.mean_itl) for o in warm if o.mean_itl]),
        # Fleet(present=N) only: what a predictor that knew the replica's exact state
        # at dispatch (but not what arrives after) would err by
        "floor_mape": mape(
            [(o.present_ttft, o.first - o.sent) for o in warm if o.present_ttft is not None]
        ),
    }


def rate_at(points: list[dict[str, float]], share: float = 0.9) -> float:
    """The highest rate with at least `share` meeting the SLO, interpolated between the
    last point above it and the first below (the sweep's first rate when none is above)."""
    ordered = sorted(points, key=lambda p: p["rate"])
    best = 0.0
    for low, high in itertools.pairwise(ordered):
        if low["slo_share"] >= share:
            best = low["rate"]
            if high["slo_share"] < share:
                span = low["slo_share"] - high["slo_share"]
                best += (high["rate"] - low["rate"]) * (low["slo_share"] - share) / span
                return best
    if ordered and ordered[-1]["slo_share"] >= share:
        return ordered[-1]["rate"]
    return best


def goodput_at(points: list[dict[str, float]], rate: float) -> float | None:
    """Requests/s meeting the SLO at `rate`, interpolated within the sweep (None outside)."""
    ordered = sorted(points, key=lambda p: p["rate"])
    for low, high in itertools.pairwise(ordered):
        if low["rate"] <= rate <= high["rate"]:
            f = (rate - low["rate"]) / (high["rate"] - low["rate"])
            return low["goodput_rps"] + f * (high["goodput_rps"] - low["goodput_rps"])
    return None


def decision_cost(replicas: int, rounds: int = 2000) -> float:
    """p99 CPU seconds of one slo-aware decision's predictions over `replicas` candidates
    (this thread's CPU time: on a shared machine wall time's p99 is other processes'
    time slices, 4-8 ms, not the decision's)."""
    predictions = Predictions()
    rng = random.Random(1)
    request = RoutingRequest(model="m", chunk_hashes=tuple(range(20)), prompt_chars=20 * 256)
    candidates = [
        Candidate(url=f"http://r{i}", in_flight=rng.randint(0, 30), running=20.0, waiting=1.0)
        for i in range(replicas)
    ]
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        predictions.costs(request, candidates, 1.0, 0.05)
        times.append(time.thread_time() - start)
    return percentile(times, 99)


def capacity(
    profiles: list[sim_profiles.Profile], jobs: list[Job], itl_seconds: float
) -> tuple[float, float, float]:
    """Upper bounds on a pool's rate for this workload, whatever the routing: (req/s
    serving every request within the SLO, req/s at which 90% can meet it in a steady
    state, req/s serving only the cheapest 90%).

    A request's work on a replica is its uncached prefill (a shared system prompt counted
    as cached) times `prefill_token_s` plus its answer times `decode_token_s`; every engine
    step also costs `step_base_s`. A request within the ITL target runs on steps at most
    that long, so at least step_base / itl of its replica's time is the base ("useful" is
    the rest). Serving all within the SLO: all work at that efficiency. 90% in a steady
    state: every request is served (its work is done, late or not), the 90% that meet at
    that efficiency, the misses at best for free of the base, and at best the misses are
    the costliest tenth. The cheapest 90% alone: the misses cost nothing (they are never
    served: what a run that ends before their work, or shedding, allows).

    Fluid bounds: they ignore KV limits and the arrival bursts. Summed over replicas,
    which bounds a pool whose replicas differ by one factor (4 H100, one H100 1.5x
    slower); a pool whose cards differ in kind (an A100 computes prompts 3.2x slower but
    decodes 1.6x slower) can do better by giving each the work it is relatively good at,
    so there the sum is a guide, not a bound."""
    work: list[tuple[float, float]] = []  # (prefill tokens, answer tokens) per job
    for i, job in enumerate(jobs):
        start = job.text.find(f"{i}:")  # a shared system prompt comes before it
        work.append(((len(job.text) - max(start, 0)) / CHARS_PER_TOKEN, job.max_tokens))
    sustained = steady = cheapest = 0.0
    for profile in profiles:
        costs = sorted(p * profile.prefill_token_s + a * profile.decode_token_s for p, a in work)
        total, meet = sum(costs), sum(costs[: int(0.9 * len(costs))])
        useful = max(0.0, 1.0 - profile.step_base_s / itl_seconds)
        if useful == 0:
            continue
        sustained += useful * len(costs) / total
        steady += len(costs) / (meet / useful + (total - meet))
        cheapest += useful * len(costs) / meet
    return sustained, steady, cheapest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", default="h100,mixed,slow")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rates", help="req/s, comma-separated (default: RATES per pool)")
    parser.add_argument(
        "--seconds", type=float, default=60.0,
        help="simulated seconds of arrivals per case (rate x seconds requests; default 60)",
    )  # fmt: skip
    parser.add_argument(
        "--requests", type=int,
        help="a fixed count per case instead (1200: the figures before 2026-12-03's runs)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--workload", choices=sorted(WORKLOADS),
        help="every pool's workload (default: the pool's own, POOL_WORKLOAD, else default)",
    )  # fmt: skip
    parser.add_argument(
        "--non-streamed", action="store_true",
        help="requests the gateway sees as non-streamed (no first token: nothing learnt)",
    )  # fmt: skip
    parser.add_argument(
        "--thresholds", choices=("none", "gateway"), default="none",
        help="none: every request goes to a replica at once (the figures before "
        "2026-12-03); gateway: the gateway's default saturation thresholds, a request "
        "waiting in the gateway while every replica is saturated and refused (429) once "
        "its TTFT budget is spent",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="every other rate, 10 s per case")
    parser.add_argument(
        "--floor", action="store_true",
        help="also the TTFT error of a predictor that knows each replica's exact state at "
        "dispatch, from every 20th request (an engine copy each: several times slower)",
    )  # fmt: skip
    parser.add_argument("--out", default="bench/results/slo_routing.json")
    args = parser.parse_args(argv)
    seconds = min(args.seconds, 10.0) if args.quick else args.seconds
    policies = args.policies.split(",")
    for policy in policies:
        if policy not in KUBELLM_POLICIES + PEER_POLICIES:
            parser.error(f"--policies: unknown {policy!r}")
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    bounds: dict[str, float] = {}  # pool -> the steady-state 90% bound
    per_case = f"{args.requests} requests" if args.requests else f"{seconds:g} s of arrivals"
    print(f"SLO: TTFT {SLO.ttft_seconds} s, ITL {SLO.itl_seconds} s; {per_case} per case")
    header = f"{'pool':6} {'policy':13} {'rate':>5} {'SLO%':>6} {'good/s':>7} {'TTFT50':>7} "
    print(header + f"{'TTFT99':>7} {'ITL99':>7} {'MAPE-T':>7} {'MAPE-I':>7}"
          + (f" {'FLOOR-T':>7}" if args.floor else ""))  # fmt: skip
    for pool in args.pools.split(","):
        results[pool] = {}
        rates = [float(r) for r in args.rates.split(",")] if args.rates else RATES[pool]
        if args.quick:
            rates = rates[1::2] or rates
        shape = WORKLOADS[args.workload or POOL_WORKLOAD.get(pool, "default")]
        sustained, steady, cheapest = capacity(
            POOLS[pool], workload(100.0, 20_000, args.seed, **shape), SLO.itl_seconds
        )
        bounds[pool] = steady
        print(f"{pool:6} capacity bound (any policy): {sustained:.1f} req/s all within the "
              f"SLO, {steady:.1f} 90% within it in a steady state, {cheapest:.1f} serving "
              "only the cheapest 90%", flush=True)  # fmt: skip
        for rate in rates:
            count = args.requests or max(int(rate * seconds), 50)
            jobs = workload(rate, count, args.seed, **shape)
            duration = jobs[-1].arrival
            for policy in policies:
                run = Fleet(
                    POOLS[pool], policy, SLO, seed=args.seed, present=20 if args.floor else 0,
                    streamed=not args.non_streamed,
                    thresholds=Thresholds() if args.thresholds == "gateway" else NEVER_SATURATED,
                ).run(jobs)  # fmt: skip
                row = summarize(run.outcomes, rate, duration)
                results[pool].setdefault(policy, []).append(row)
                print(f"{pool:6} {policy:13} {rate:5g} {100 * row['slo_share']:6.1f} "
                      f"{row['goodput_rps']:7.1f} {row['ttft_p50']:7.3f} {row['ttft_p99']:7.3f} "
                      f"{row['itl_p99']:7.4f} {100 * row['ttft_mape']:6.1f}% "
                      f"{100 * row['itl_mape']:6.1f}%"
                      + (f" {100 * row['floor_mape']:6.1f}%" if args.floor else ""),
                      flush=True)  # fmt: skip
    costs = {n: decision_cost(n) for n in (4, 16)}
    print(f"\nslo-aware decision cost p99: 4 replicas {1e6 * costs[4]:.0f} us, "
          f"16 replicas {1e6 * costs[16]:.0f} us")  # fmt: skip
    verdicts = verdict(results, costs, bounds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"results": results, "decision_cost_p99": costs,
                                          "verdicts": verdicts}, indent=1))  # fmt: skip
    return 0


def verdict(
    results: dict[str, dict[str, list[dict[str, float]]]],
    costs: dict[int, float],
    bounds: dict[str, float] | None = None,
) -> list[str]:
    lines = []
    print("\n90%-rate (req/s at which 90% meet both SLOs):")
    for pool, by_policy in results.items():
        knees = {p: rate_at(points) for p, points in by_policy.items()}
        print(f"  {pool}: " + ", ".join(f"{p} {r:.1f}" for p, r in knees.items()))
        if "slo-aware" not in knees or "prefix-aware" not in knees:
            continue
        mine, base = knees["slo-aware"], knees["prefix-aware"]
        peers = [knees[p] for p in PEER_POLICIES if p in knees]
        ok = mine >= 1.2 * base and all(mine >= p for p in peers)
        lines.append(f"{pool}: 90%-rate {mine:.1f} vs prefix-aware {base:.1f} "
                     f"(x{mine / base if base else float('inf'):.2f}), best peer "
                     f"{max(peers, default=0):.1f}: {'MET' if ok else 'NOT MET'} "
                     "(>= 1.2x prefix-aware and >= every peer)")  # fmt: skip
        bound = (bounds or {}).get(pool)
        if not ok and bound is not None and 1.2 * base > bound:
            lines.append(f"{pool}: 1.2x prefix-aware's 90%-rate is {1.2 * base:.1f} req/s, above "
                         f"the pool's steady-state bound {bound:.1f} (capacity): out of reach "
                         "for any policy")  # fmt: skip
        past = 1.4 * base
        at = {p: goodput_at(points, past) for p, points in by_policy.items()}
        if at.get("slo-aware") is None or at.get("prefix-aware") is None:
            lines.append(f"{pool}: {past:.1f} req/s (1.4x prefix-aware's 90%-rate) is outside "
                         "the sweep: NOT MEASURED")  # fmt: skip
        else:
            others = {p: g for p, g in at.items() if p in PEER_POLICIES and g is not None}
            ok = at["slo-aware"] >= 1.2 * at["prefix-aware"] and all(
                at["slo-aware"] >= g for g in others.values()
            )
            peers_text = ", ".join(f"{p} {g:.1f}" for p, g in others.items())
            lines.append(f"{pool}: at {past:.1f} req/s SLO-meeting req/s: slo-aware "
                         f"{at['slo-aware']:.1f}, prefix-aware {at['prefix-aware']:.1f}, "
                         f"{peers_text}: {'MET' if ok else 'NOT MET'} "
                         "(>= 1.2x prefix-aware, >= peers)")  # fmt: skip
        worse = [
            (a["rate"], a["slo_share"], b["slo_share"])
            for a, b in zip(by_policy["slo-aware"], by_policy["prefix-aware"], strict=True)
            if a["slo_share"] < b["slo_share"] - 0.02
        ]
        bad = [w[0] for w in worse] or "none"
        lines.append(f"{pool}: rates where slo-aware is > 2 points worse than prefix-aware: "
                     f"{bad}: {'NOT MET' if worse else 'MET'}")  # fmt: skip
        mape = max(p["ttft_mape"] for p in by_policy["slo-aware"])
        lines.append(f"{pool}: slo-aware TTFT MAPE up to {100 * mape:.1f}%: "
                     f"{'MET' if mape <= 0.15 else 'NOT MET'} (<= 15%)")  # fmt: skip
    lines.append(f"decision cost p99 at 16 replicas {1e6 * costs[16]:.0f} us: "
                 f"{'MET' if costs[16] <= 1e-3 else 'NOT MET'} (<= 1 ms)")  # fmt: skip
    print("\nVerdict against issue #30's targets:")
    for line in lines:
        print("  " + line)
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
