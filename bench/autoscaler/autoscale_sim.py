"""Fleet simulation: the cheapest fleet that meets the SLO, with the fallback taking spikes.

A discrete-event simulation on a simulated clock (no HTTP, no sleeping) of
one LLMDeployment: simulated engine replicas (`kubellm.engine.sim_core`,
Llama 3.1 8B on an 80 GB GPU), a 60 s model load for every new replica,
least-load routing, and the real autoscaler policies driven every 5
simulated seconds from the replicas' /metrics and the gateway's counters,
as the `kubellm autoscaler` loop drives them. Traces: a step, a ramp and a
bursty day (six hours in real time: a diurnal rise plus short spikes), seeded;
or a recorded trace (`--trace FILE.csv`). Every trace runs in simulated real
time: the model load, the control period and the scale-down window keep
their real length.

Policies: first `defaults`, what a deployment with a fallback and nothing else set gets
(kv-queue with the spec's defaults: targetRequestsPerReplica derived from what saturated
replicas answer, maxFallbackShare 0.05); then a fixed fleet sized for the peak, a KPA-style
concurrency target,
`kv-queue`, `kv-queue+fallback` (kv-queue with the gateway's own admission
sending overflow to a modelled fallback API; `--fallback-shares` runs it
again at other values of maxFallbackShare), `kv-queue+fallback+cost` (the same
with the cost rule: spec.autoscaling.fallbackCostRatio from the run's prices
and trace) and all-API; on request, `kv-queue+predict`, `kv-queue+fallback+predict`
and `kv-queue+fallback+cost+predict` (the same with spec.autoscaling.predictive:
the trend forecast one model load ahead). `--traces bursty-hour,smooth-hour` adds
two generated hours shaped like the Azure code and conversation traces superposed
x8; `--api-max-concurrency N` sizes the fallback.

Per trace and policy it reports SLO attainment (TTFT <= 2 s and mean ITL <=
0.1 s; a request the fallback served counts when the API's modelled latency
meets them), goodput, replica-seconds, the fallback's share, the cost
(GPU-hours at --gpu-hour-price plus the tokens the API served at its prices),
scaling direction changes (in all, and the most in any scale-down window) and
the time from the queue passing its target to the scale-up decision; per
trace, reference sizings; then checks the targets of issue #17. Writes
`summary.json` and `autoscale.png` to --out (and the figures per policy to
--json). Details: kubellm/simulation/ (shared with `kubellm plan --trace`).

    python -m bench.autoscale_sim [--mix long|short] [--out bench/out] [--json FILE]
    python -m bench.autoscale_sim --trace day.csv --rate-scale 2 --gpu-hour-price 4
    # what-ifs: a spec.autoscaling override (targetRequestsPerReplica=none: derived)
    python -m bench.autoscale_sim --traces bursty-day --set minReplicas=2
    python -m bench.autoscale_sim --traces compressed-day  # issue #6's day, for its figures
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
from kubellm.simulation import experiment, report, traces
from kubellm.simulation.gateway import ApiModel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default=None, help="comma-separated built-in traces: "
                        + ", ".join((*experiment.TRACES, *experiment.EXTRA_TRACES))
                        + f" (default: {','.join(experiment.TRACES)}; "
                        "none with --trace)")  # fmt: skip
    parser.add_argument("--trace", type=Path, metavar="FILE",
                        help="a recorded trace: a CSV with a timestamp column and prompt and "
                        "output token columns (timestamp, prompt_tokens | input_tokens | "
                        "ContextTokens, output_tokens | GeneratedTokens; any case), or a JSONL "
                        "(.jsonl) of objects with those fields")  # fmt: skip
    parser.add_argument("--rate-scale", type=float, default=1.0, metavar="X",
                        help="with --trace: superpose X copies of it, each circularly "
                        "shifted by a random offset (same length and burstiness, X x the "
                        "rate)")  # fmt: skip
    parser.add_argument("--policies", default=",".join(experiment.POLICIES),
                        help="comma-separated; also " + ", ".join(experiment.PREDICTIVE_POLICIES)
                        + " (the same with spec.autoscaling.predictive)")  # fmt: skip
    parser.add_argument("--fallback-shares", default="0", metavar="S,...",
                        help="kv-queue+fallback runs again with maxFallbackShare set to "
                        "each (the knob's effect; the spec's default always runs); '' for "
                        "none")  # fmt: skip
    parser.add_argument("--mix", choices=sorted(experiment.CAPACITY_RPS), default="long",
                        help="request sizes: long (~2,400 prompt / ~200 output tokens, KV-bound) "
                        "or short (~800 / ~40, compute-bound)")  # fmt: skip
    parser.add_argument("--scale", type=float, default=1.0, help="stretch every trace's length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-seconds", type=float, default=experiment.LOAD_SECONDS)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a spec.autoscaling field for the policies (what-if), e.g. "
                        "--set minReplicas=2 --set targetKVCacheUsage=0.4")  # fmt: skip
    api_defaults = ApiModel()
    parser.add_argument("--gpu-hour-price", type=float, default=experiment.GPU_HOUR_PRICE,
                        metavar="$", help="price of one GPU-hour (replica-hours here)")  # fmt: skip
    parser.add_argument("--api-input-price-per-million", type=float, metavar="$",
                        default=api_defaults.input_price_per_million)  # fmt: skip
    parser.add_argument("--api-output-price-per-million", type=float, metavar="$",
                        default=api_defaults.output_price_per_million)  # fmt: skip
    parser.add_argument("--api-ttft", type=float, default=api_defaults.ttft_seconds,
                        metavar="S", help="the fallback API's time to first token")  # fmt: skip
    parser.add_argument("--api-itl", type=float, default=api_defaults.itl_seconds,
                        metavar="S", help="the fallback API's time between tokens")  # fmt: skip
    parser.add_argument("--api-max-concurrency", type=int, default=api_defaults.max_concurrency,
                        metavar="N", help="spec.fallback.maxConcurrency: the most requests "
                        "the API serves at once from the gateway")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (runs in parallel)")
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="write the figures per trace and policy to FILE")  # fmt: skip
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-curve", action="store_true", help="skip the one-replica load curve")
    parser.add_argument("--write-traces", type=Path, metavar="DIR",
                        help="write each --traces trace's requests to DIR/NAME.csv (what "
                        "`kubellm plan --trace` reads) and exit")  # fmt: skip
    args = parser.parse_args(argv)
    if args.traces is None:
        args.traces = "" if args.trace else ",".join(experiment.TRACES)
    args.traces = [t for t in args.traces.split(",") if t]
    args.policies = [p for p in args.policies.split(",") if p]
    known_traces = (*experiment.TRACES, *experiment.EXTRA_TRACES)
    for name in args.traces:
        if name not in known_traces:
            parser.error(f"--traces: unknown trace {name!r}; known: {', '.join(known_traces)}")
    known = experiment.KNOWN_POLICIES
    for name in args.policies:
        if name not in known:
            parser.error(f"--policies: unknown policy {name!r}; known: {', '.join(known)}")
    if args.scale <= 0:
        parser.error("--scale must be positive")
    if args.rate_scale <= 0:
        parser.error("--rate-scale must be positive")
    for flag in ("gpu_hour_price", "api_input_price_per_million", "api_output_price_per_million",
                 "api_ttft", "api_itl"):  # fmt: skip
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must not be negative")
    if args.api_max_concurrency < 1:
        parser.error("--api-max-concurrency must be at least 1")
    try:
        args.fallback_shares = [float(v) for v in args.fallback_shares.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--fallback-shares: expected numbers in [0, 1], got {args.fallback_shares!r}")
    if any(not 0 <= v <= 1 for v in args.fallback_shares):
        parser.error("--fallback-shares: each share must be in [0, 1]")
    args.spec = spec_overrides(parser, args.set)
    args.api = ApiModel(
        ttft_seconds=args.api_ttft,
        itl_seconds=args.api_itl,
        input_price_per_million=args.api_input_price_per_million,
        output_price_per_million=args.api_output_price_per_million,
        max_concurrency=args.api_max_concurrency,
    )
    if args.trace is not None:
        try:
            args.recorded = traces.read_file(args.trace, args.rate_scale, args.seed)
        except traces.TraceError as error:
            parser.error(f"--trace: {error}")
    else:
        args.recorded = None
    if not args.traces and args.trace is None:
        parser.error("--traces: nothing to run")
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


# Issue #6's figures on its compressed day (24 h in 1,440 s, loads and windows in real seconds),
# kept beside the new ones: that workload mixed time scales, and this one replaced it.
OLD_FIGURES = (
    "before (#6, compressed day: 24 h in 1,440 simulated s, 60 s loads and the 300 s window in "
    "real s; --traces compressed-day): kv-queue 99.93% at 6,060 replica-s = 84% of fixed (7,200), "
    "KPA-style 86.63% at 5,956"
)


# This first pass on the bursty day, before the gateway's --max-waiting default went
# from 8 to 4 and the scale-down window (with a fallback) remembered the 30 s rate's ask.
BEFORE_FALLBACK_FIGURES = (
    "before (gateway --max-waiting 8, the last period's rate held for the window): "
    "kv-queue+fallback 99.51% at 65,324 replica-s, fallback 0.40%, $46.10 = 61% of fixed; "
    "share=0 99.52% at $45.92"
)


def default_share(args: argparse.Namespace) -> float:
    """maxFallbackShare as the spec gives it (the default, or a --set override)."""
    return experiment.autoscaling(args.mix, **dict(args.spec)).max_fallback_share


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.write_traces is not None:
        for name in args.traces:
            trace = experiment.make_trace(name, args.mix, args.scale, args.seed)
            path = args.write_traces / f"{name}.csv"
            traces.write_csv(path, trace.arrivals(args.seed, traces.MIXES[args.mix]))
            print(f"wrote {path}")
        return 0
    calibration = experiment.calibrate(args.mix)
    capacity = experiment.CAPACITY_RPS[args.mix]
    # One replica's KV usage and in-flight requests against its load: the policies' inputs.
    curve = [
        experiment.calibrate(args.mix, capacity * share, seconds=60.0)
        for share in (0.25, 0.5, 0.75, 1.0, 1.15, 1.25)
        if not args.no_curve
    ]
    common = {
        "mix": args.mix,
        "seed": args.seed,
        "scale": args.scale,
        "kpa_target": round(calibration["concurrency"], 1),
        "load_seconds": args.load_seconds,
        "spec": args.spec,
        "api_model": args.api,
        "gpu_hour_price": args.gpu_hour_price,
    }
    sources = [(name, None) for name in args.traces]
    if args.trace is not None:
        sources.append((args.recorded.name, str(args.trace)))
    jobs = []
    for trace, path in sources:
        for policy in args.policies:
            shares = [None]
            if policy == experiment.FALLBACK:
                shares += [s for s in args.fallback_shares if s != default_share(args)]
            for share in shares:
                jobs.append(
                    experiment.Job(
                        trace,
                        policy,
                        fallback_share=share,
                        trace_file=path,
                        rate_scale=args.rate_scale,
                        **common,
                    )
                )
    if args.jobs > 1:
        # the longest runs first, so the pool's workers finish together
        order = sorted(range(len(jobs)), key=lambda i: jobs[i].policy in ("all-api",))
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            done = dict(zip(order, pool.map(experiment.run, [jobs[i] for i in order]), strict=True))
        outcomes = [done[i] for i in range(len(jobs))]
    else:
        outcomes = [experiment.run(job) for job in jobs]
    summaries = [summary for summary, _ in outcomes]
    checks = report.targets(summaries, experiment.PERIOD) + report.oracle_targets(summaries)

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
    api_model = args.api
    print(
        f"cost: ${args.gpu_hour_price:g} per GPU-hour (replica-hours, loading included) + "
        f"fallback API tokens at ${api_model.input_price_per_million:g} / "
        f"${api_model.output_price_per_million:g} per million in / out; the API answers in "
        f"TTFT {api_model.ttft_seconds:g} s, ITL {api_model.itl_seconds:g} s, at most "
        f"{api_model.max_concurrency} at once from the gateway "
        f"(maxFallbackShare {default_share(args):g})"
    )
    per_replica = {s["policy"]: s["target_requests_per_replica"] for s in summaries}
    print(
        "targetRequestsPerReplica: "
        + ", ".join(f"{name} {value:g}" for name, value in per_replica.items() if value)
        + f" (kv-queue: {experiment.RATE_TARGET:g} x a replica's capacity, headroom for spikes "
        "faster than a model load; with the fallback: "
        f"{experiment.FALLBACK_RATE_TARGET:g} x, the fallback takes them)"
    )
    for trace, _ in sources:
        run = next(s for s in summaries if s["trace"] == trace)
        print(f"{trace}: {run['trace_description']}")
    if args.recorded is not None and args.recorded.clipped:
        print(f"{args.recorded.name}: {args.recorded.clipped} requests clipped to the replicas' "
              f"limits ({traces.MAX_PROMPT_TOKENS} prompt, {traces.MAX_OUTPUT_TOKENS} output "
              "tokens)")  # fmt: skip
    print()
    print(report.table(summaries))
    print()
    print(report.lower_bounds(summaries))
    print()
    print(report.breakdown_text(summaries, args.gpu_hour_price))
    print()
    print(report.targets_text(checks))
    if "bursty-day" in args.traces:
        print()
        print(OLD_FIGURES)
        print(BEFORE_FALLBACK_FIGURES)

    args.out.mkdir(parents=True, exist_ok=True)
    document = {
        "args": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("api", "recorded")
        },
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
            "routing": "least-load (fewest waiting + running on ready replicas); "
            "kv-queue+fallback: the gateway's admission (production decide) and the fallback",
            "cost": {
                "gpu_hour_price": args.gpu_hour_price,
                "api": args.api.__dict__,
            },
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
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.per_policy(summaries), indent=1))
        paths.append(args.json)
    if not args.no_plot:
        report.plot(
            [r for _, r in outcomes], capacity, args.out / "autoscale.png", experiment.PERIOD
        )
        paths.append(args.out / "autoscale.png")
    print()
    print(f"wrote {', '.join(map(str, paths))} in {time.perf_counter() - started:.0f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
