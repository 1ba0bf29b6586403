"""Fleet simulation: kubellm's autoscaling policy against a KPA-style one and a fixed fleet.

A discrete-event simulation on a simulated clock (no HTTP, no sleeping) of
one LLMDeployment: simulated engine replicas (`kubellm.engine.sim_core`,
Llama 3.1 8B on an 80 GB GPU), a 60 s model load for every new replica,
least-load routing, and the real autoscaler policies driven every 5
simulated seconds from the replicas' /metrics, as the `kubellm autoscaler`
loop drives them. Traces: a step, a ramp and a bursty day (diurnal curve plus
spikes, 24 h compressed into 24 simulated minutes), seeded.

Per trace and policy it reports SLO attainment (TTFT <= 2 s and mean ITL <=
0.1 s), goodput, replica-seconds, scaling direction changes (in all, and the
most in any scale-down window) and the time from the queue passing its target
to the scale-up decision; per trace, the replica-seconds of replicas that
appear instantly, sized at a replica's capacity (the oracle) and at the rate
signal's ask without and with the scale-down window (what the sizing rule
itself costs); then checks the targets of issue #6. Writes
`summary.json` and `autoscale.png` to --out. Details: bench/_autoscale/.

    python bench/autoscale_sim.py [--mix long|short] [--out bench/out]
    # what-ifs: a spec.autoscaling override (targetRequestsPerReplica=none: no rate signal)
    python bench/autoscale_sim.py --traces bursty-day --set minReplicas=2
    python bench/autoscale_sim.py --set targetRequestsPerReplica=none
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pydantic import ValidationError

from kubellm import api

# Run as a script, bench/ is on sys.path; run from the repository root, as `bench._autoscale`.
try:
    from _autoscale import experiment, report
except ImportError:  # imported as bench.autoscale_sim (tests)
    from bench._autoscale import experiment, report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default=",".join(experiment.TRACES))
    parser.add_argument("--policies", default=",".join(experiment.POLICIES), help="comma-separated")
    parser.add_argument("--mix", choices=sorted(experiment.CAPACITY_RPS), default="long",
                        help="request sizes: long (~2,400 prompt / ~200 output tokens, KV-bound) "
                        "or short (~800 / ~40, compute-bound)")  # fmt: skip
    parser.add_argument("--scale", type=float, default=1.0, help="stretch every trace's length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-seconds", type=float, default=experiment.LOAD_SECONDS)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a spec.autoscaling field for the policies (what-if), e.g. "
                        "--set minReplicas=2 --set targetKVCacheUsage=0.4")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (runs in parallel)")
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-curve", action="store_true", help="skip the one-replica load curve")
    args = parser.parse_args(argv)
    args.traces = [t for t in args.traces.split(",") if t]
    args.policies = [p for p in args.policies.split(",") if p]
    for name in args.traces:
        if name not in experiment.TRACES:
            parser.error(f"--traces: unknown trace {name!r}; known: {', '.join(experiment.TRACES)}")
    known = experiment.POLICIES
    for name in args.policies:
        if name not in known:
            parser.error(f"--policies: unknown policy {name!r}; known: {', '.join(known)}")
    if args.scale <= 0:
        parser.error("--scale must be positive")
    args.spec = spec_overrides(parser, args.set)
    return args


def spec_overrides(parser: argparse.ArgumentParser, items: list[str]) -> tuple:
    """`--set camelCaseField=value` pairs, validated against the LLMDeployment API model."""
    overrides: dict[str, object] = {}
    fields = {f.alias or name: name for name, f in api.Autoscaling.model_fields.items()}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            parser.error(f"--set {item!r}: expected FIELD=VALUE, FIELD one of {', '.join(fields)}")
        overrides[fields[key]] = None if value.lower() in ("none", "null") else value
    try:
        spec = experiment.autoscaling(**overrides)
    except ValidationError as error:
        camel = {name: alias for alias, name in fields.items()}
        problems = "; ".join(
            f"{camel.get(str(e['loc'][0]), e['loc'][0])}: {e['msg']}" for e in error.errors()
        )
        parser.error(f"--set: {problems}")
    return tuple((name, getattr(spec, name)) for name in overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    calibration = experiment.calibrate(args.mix)
    capacity = experiment.CAPACITY_RPS[args.mix]
    # One replica's KV usage and in-flight requests against its load: the policies' inputs.
    curve = [
        experiment.calibrate(args.mix, capacity * share, seconds=60.0)
        for share in (0.25, 0.5, 0.75, 1.0, 1.15, 1.25)
        if not args.no_curve
    ]
    jobs = [
        experiment.Job(
            trace,
            policy,
            mix=args.mix,
            seed=args.seed,
            scale=args.scale,
            kpa_target=round(calibration["concurrency"], 1),
            load_seconds=args.load_seconds,
            spec=args.spec,
        )
        for trace in args.traces
        for policy in args.policies
    ]
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            outcomes = list(pool.map(experiment.run, jobs))
    else:
        outcomes = [experiment.run(job) for job in jobs]
    summaries = [summary for summary, _ in outcomes]
    checks = report.targets(summaries, experiment.PERIOD) if "kv-queue" in args.policies else []

    cal = calibration
    print(
        f"fleet: llama-3.1-8b-h100 (maxNumSeqs 128, maxNumBatchedTokens 2048), {args.mix} mix; "
        f"one replica = {capacity:g} req/s (calibrated: {cal['slo_attainment']:.1%} SLO met, "
        f"{cal['concurrency']:.1f} in flight, KV {cal['kv_cache_usage']:.2f})"
    )
    print(
        f"SLO: TTFT <= 2 s and mean ITL <= 0.1 s; model load {args.load_seconds:g} s; control "
        f"period {experiment.PERIOD:g} s; KPA target {jobs[0].kpa_target:g} in flight/replica"
    )
    if curve:
        points = ", ".join(
            f"{c['rate']:g} req/s: {c['kv_cache_usage']:.2f}/{c['concurrency']:.0f}/"
            f"{c['slo_attainment']:.0%}"
            for c in curve
        )
        print(f"one replica, KV usage / in flight / SLO met at {points}")
    if args.spec:
        print("what-if spec.autoscaling: " + ", ".join(f"{k}={v}" for k, v in args.spec))
    print()
    print(report.table(summaries))
    print()
    print(report.lower_bounds(summaries))
    print()
    print(report.targets_text(checks))

    args.out.mkdir(parents=True, exist_ok=True)
    document = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "setup": {
            "profile": "llama-3.1-8b-h100",
            "engine_overrides": {"max_num_seqs": 128, "max_num_batched_tokens": 2048},
            "mix": args.mix,
            "capacity_rps_per_replica": capacity,
            "calibration": calibration,
            "load_curve": curve,
            "slo": {"ttft_seconds": 2.0, "itl_seconds": 0.1, "itl": "mean per request"},
            "autoscaling": experiment.autoscaling(args.mix, **dict(args.spec)).model_dump(
                by_alias=True
            ),
            "period_s": experiment.PERIOD,
            "load_seconds": args.load_seconds,
            "routing": "least-load (fewest waiting + running on ready replicas); no fallback",
            "kpa_target_concurrency": jobs[0].kpa_target,
        },
        "runs": summaries,
        "targets": checks,
        "timeseries": {
            f"{r.trace}/{r.policy}": [s.__dict__ for s in r.samples] for _, r in outcomes
        },
    }
    (args.out / "summary.json").write_text(json.dumps(document, indent=1))
    paths = [args.out / "summary.json"]
    if not args.no_plot:
        report.plot([r for _, r in outcomes], capacity, args.out / "autoscale.png")
        paths.append(args.out / "autoscale.png")
    print()
    print(f"wrote {', '.join(map(str, paths))} in {time.perf_counter() - started:.0f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
