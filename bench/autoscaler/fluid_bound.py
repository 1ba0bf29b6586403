"""Fluid bound: how near the oracle a reactive autoscaler can get at >= 99% attainment.

No engine, no queue: the trace's exact rate curve, second by second. Every
5 s the fleet is asked `ceil((rate + spare) / capacity)` replicas (the rate
seen one period ago); a scale-up is ready `--load-seconds` later, a
scale-down waits until every ask of the last `hold` seconds agrees (the
stabilisation window). The fallback carries `--fallback-rps` at once (its
maxConcurrency over a mean API request: 64 / (0.6 s + 0.025 s x 239 tokens) =
9.7 requests/s). Misses are the arrivals above what the ready replicas and
the fallback carry. Per trace it prints, for each hold and spare, the miss
share and the replica-seconds over the oracle's (instant replicas,
`ceil(rate / capacity)` each second). It is optimistic against the
simulation (replicas at their capacity still meet the SLO, no request is
late, the rate is known exactly): a rule of this family that misses the
targets here misses them there.

    python -m bench.fluid_bound --traces bursty-hour,smooth-hour
"""

from __future__ import annotations

import argparse
import math
import sys

from kubellm.simulation import experiment

PERIOD = 5


def fleet(
    rates: list[float],
    capacity: float,
    spare: float,
    hold: float,
    load: float,
    fallback: float,
) -> tuple[float, float]:
    """(missed requests, replica-seconds) of the reactive fleet on per-second `rates`."""
    live = max(1, math.ceil(rates[0] / capacity - 1e-9))  # the first second's need, ready
    ready, pending, asks = live, [], []
    missed = paid = 0.0
    for t, rate in enumerate(rates):
        if t % PERIOD == 0:
            seen = rates[max(0, t - PERIOD)]
            ask = max(1, math.ceil((seen + spare) / capacity - 1e-9))
            asks = [(s, a) for s, a in asks if s > t - hold] + [(t, ask)]
            target = ask if ask >= live else max(a for _, a in asks)
            if target > live:
                pending.append((t + load, target - live))
            drop = max(0, live - target)
            while drop and pending:  # starting replicas go first
                at, count = pending.pop()
                taken = min(count, drop)
                drop -= taken
                if count > taken:
                    pending.append((at, count - taken))
            ready -= drop
            live = target
        while pending and pending[0][0] <= t:
            ready += pending.pop(0)[1]
        paid += live
        missed += max(0.0, rate - ready * capacity - fallback)
    return missed, paid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default="bursty-hour,smooth-hour", help="comma-separated")
    parser.add_argument("--capacity", type=float, default=experiment.CAPACITY_RPS["long"])
    parser.add_argument("--load-seconds", type=float, default=experiment.LOAD_SECONDS)
    parser.add_argument("--fallback-rps", type=float, default=64 / (0.6 + 0.025 * 239))
    parser.add_argument("--holds", default="0,60,120,300", help="seconds, comma-separated")
    parser.add_argument("--spares", default="0,3.5,7,10.5,14", help="requests/s, comma-separated")
    args = parser.parse_args(argv)
    holds = [float(h) for h in args.holds.split(",")]
    spares = [float(s) for s in args.spares.split(",")]
    for name in [t for t in args.traces.split(",") if t]:
        trace = experiment.make_trace(name)
        rates = [trace.rate(t + 0.5) for t in range(int(trace.duration))]
        oracle = sum(max(1, math.ceil(r / args.capacity - 1e-9)) for r in rates)
        print(f"{name}: miss share / replica-s over the oracle's ({oracle:,})")
        for hold in holds:
            cells = []
            for spare in spares:
                missed, paid = fleet(
                    rates, args.capacity, spare, hold, args.load_seconds, args.fallback_rps
                )
                cells.append(f"spare {spare:g}: {missed / sum(rates):.2%} {paid / oracle:.2f}x")
            print(f"  hold {hold:3g} s: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
