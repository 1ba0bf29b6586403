"""`kubellm plan --trace FILE`: replicas, cost and SLO attainment for a recorded trace.

Given a trace of requests (arrival time, prompt and output tokens: the CSV
columns `python -m bench.autoscale_sim --trace` reads, or a JSONL of the same
fields), the SLO and the prices, it answers what a platform team asks before
buying GPUs:

- the oracle fleet: replicas the load needs per interval if replicas appeared
  the moment they were wanted (`ceil(rate / capacity)`, a lower bound), and
  the peak fleet (the most of them, held all along: no autoscaler);
- kubellm's autoscaler on the trace, simulated (this package's fleet
  simulation, the same runs as the benchmark): without a fallback, and with
  one under the cost rule (`spec.autoscaling.fallbackCostRatio`, computed here
  from the prices and the trace's request sizes); replica-hours, cost, SLO
  attainment, the fallback's share;
- every request at the API instead, and the break-even between the two.

What it models and what not: see docs/autoscaling.md ("Planning from a
trace"). In short: one replica is the simulated engine's
`llama-3.1-8b-h100` profile (Llama 3.1 8B bf16 on one 80 GB GPU, maxNumSeqs
128, chunked prefill at 2,048 tokens), its capacity at the SLO measured on
the trace's own request sizes unless `--capacity` gives it; routing is
least-load with no prefix reuse; a new replica takes `--load-seconds` to
serve; the API answers with a fixed TTFT and ITL at most maxConcurrency at
once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from kubellm import api, manifests
from kubellm.engine.sim_profiles import PROFILES, Profile
from kubellm.simulation import calibrate, experiment, pd, traces
from kubellm.simulation.fleet import Fleet
from kubellm.simulation.gateway import ApiModel

POLICIES = ("kv-queue", experiment.FALLBACK, experiment.COST, *experiment.PREDICTIVE_POLICIES)
DEFAULT_POLICIES = ("kv-queue", experiment.COST)
LABELS = {
    "kv-queue": "autoscaler, no fallback",
    experiment.FALLBACK: "autoscaler + fallback (maxFallbackShare)",
    experiment.COST: "autoscaler + fallback (cost rule)",
}
LABELS.update({f"{k}{experiment.PREDICT}": f"{v}, predictive" for k, v in list(LABELS.items())})
DEFAULT_GPU_HOUR_PRICE = experiment.GPU_HOUR_PRICE
DEFAULT_API_PRICE = 0.20
CALIBRATION_SECONDS = 120.0
PROFILE = "llama-3.1-8b-h100"  # one simulated replica (experiment's)
OBJECTIVE = 0.99


def _fail(message: str) -> int:
    print(f"kubellm plan: {message}", file=sys.stderr)
    return 2


def _from_manifest(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """`-f FILE`: an LLMDeployment's spec.autoscaling (every field), spec.slo,
    spec.fallback.maxConcurrency and spec.resources.gpu.count stand in for the flags left
    unset. Returns the spec.autoscaling overrides for the runs."""
    found = list(manifests.load(args.filename))
    if len(found) != 1:
        raise ValueError(f"-f {args.filename}: expected one LLMDeployment, found {len(found)}")
    spec = found[0].spec
    if args.ttft is None:
        args.ttft = spec.slo.ttft_seconds
    if args.itl is None:
        args.itl = spec.slo.itl_seconds
    if args.api_max_concurrency is None and spec.fallback is not None:
        args.api_max_concurrency = spec.fallback.max_concurrency
    args.tensor_parallel = max(1, spec.resources.gpu.count)
    auto = spec.autoscaling
    if auto is None:
        return ()
    if args.min_replicas is None:
        args.min_replicas = max(1, auto.min_replicas)
    if args.max_replicas is None:
        args.max_replicas = auto.max_replicas
    if args.load_seconds is None:
        args.load_seconds = float(auto.model_load_seconds)
    skip = ("enabled", "min_replicas", "max_replicas")
    return tuple(
        (name, getattr(auto, name)) for name in type(auto).model_fields if name not in skip
    )


def _defaults(args: argparse.Namespace) -> None:
    """Fill the `--trace` options left unset (their defaults live here, with the model)."""
    defaults = {
        "rate_scale": 1.0,
        "ttft": api.SLO().ttft_seconds,
        "itl": api.SLO().itl_seconds,
        "load_seconds": experiment.LOAD_SECONDS,
        "min_replicas": 1,
        "max_replicas": 8,
        "api_ttft": ApiModel.ttft_seconds,
        "api_itl": ApiModel.itl_seconds,
        "api_max_concurrency": ApiModel.max_concurrency,
        "interval": 300.0,
        "policies": ",".join(DEFAULT_POLICIES),
        "seed": 0,
        "calibrate": None,
        "calibrate_model": None,
        "calibrate_start": 1.0,
        "calibrate_seconds": calibrate.DEFAULT_SECONDS,
        "calibrate_max_points": calibrate.DEFAULT_MAX_POINTS,
        "calibrate_bisections": calibrate.DEFAULT_BISECTIONS,
        "calibrate_timeout": 120.0,
        "calibrate_prompt_tokens": None,
        "calibrate_output_tokens": None,
        "pd": None,
        "pd_link_gbps": pd.LINK / 1e9,
    }
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def _check(args: argparse.Namespace) -> str | None:
    positive = ("rate_scale", "ttft", "itl", "interval")
    for name in positive:
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be positive"
    for name in ("load_seconds", "api_ttft", "api_itl"):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must not be negative"
    if args.capacity is not None and not args.capacity > 0:
        return "--capacity must be positive"
    if args.calibrate and args.capacity is not None:
        return "--calibrate measures the capacity: leave --capacity out"
    if args.calibrate and not str(args.calibrate).startswith(("http://", "https://")):
        return f"--calibrate: expected an http:// or https:// URL, got {args.calibrate!r}"
    for name in ("calibrate_start", "calibrate_seconds", "calibrate_timeout"):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be positive"
    for name in ("calibrate_max_points", "calibrate_prompt_tokens", "calibrate_output_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.calibrate_bisections < 0:
        return "--calibrate-bisections must not be negative"
    if args.min_replicas < 1 or args.max_replicas < args.min_replicas:
        return "--min-replicas must be at least 1 and at most --max-replicas"
    if args.pd is not None and args.pd < 2:
        return "--pd: a prefill and a decode role need at least 2 replicas"
    if not args.pd_link_gbps > 0:
        return "--pd-link-gbps must be positive"
    if args.api_max_concurrency < 1:
        return "--api-max-concurrency must be at least 1"
    if args.gpu_hour_price is not None and args.gpu_hour_price <= 0:
        return "--gpu-hour-price must be positive"
    unknown = [p for p in args.policies.split(",") if p and p not in POLICIES]
    if unknown:
        return f"--policies: unknown {', '.join(unknown)}; known: {', '.join(POLICIES)}"
    return None


def meets(
    sizes: list[tuple[int, int]],
    slo: api.SLO,
    rate: float,
    slowdown: float = 1.0,
    seed: int = 0,
    objective: float = OBJECTIVE,
) -> bool:
    """Whether one simulated replica (step costs x `slowdown`) meets `objective` of `slo` at
    `rate` requests/s (Poisson arrivals over `CALIBRATION_SECONDS`) sized as `sizes`."""
    # common random numbers: one seeded unit-rate sequence, compressed to `rate`, so that
    # runs at nearby rates and step costs see the same arrivals and their verdicts are
    # comparable (the fit bisects on them)
    rng = random.Random(f"calibrate/{seed}")
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0) / rate
        size = rng.choice(sizes)
        if t >= CALIBRATION_SECONDS:
            break
        out.append(traces.Arrival(t, *size))
    if not out:
        return True
    config = experiment.config(slo=slo, slowdown=slowdown)
    result = Fleet(config, None, out, CALIBRATION_SECONDS).run()
    return result.met >= objective * result.requests


def calibrate_capacity(
    arrivals: list[traces.Arrival],
    slo: api.SLO,
    seed: int = 0,
    objective: float = OBJECTIVE,
    slowdown: float = 1.0,
    profile: Profile | None = None,
) -> float:
    """Requests/s one simulated replica (`profile`, default the plan's 8B replica) serves
    with `objective` of requests meeting `slo`, for requests sized as the trace's (drawn
    from them, Poisson arrivals), to 0.1 req/s."""
    rng = random.Random(f"calibrate/{seed}")
    sizes = [(a.prompt_tokens, a.output_tokens) for a in arrivals]

    def attained(rate: float) -> bool:
        out, t = [], 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= CALIBRATION_SECONDS:
                break
            out.append(traces.Arrival(t, *rng.choice(sizes)))
        if not out:
            return True
        config = experiment.config(slo=slo, slowdown=slowdown)
        if profile is not None:
            config = dataclasses.replace(config, profile=profile.slowed(slowdown))
        result = Fleet(config, None, out, CALIBRATION_SECONDS).run()
        return result.met >= objective * result.requests

    low, high = 0.0, 1.0
    while attained(high) and high < 1024:
        low, high = high, high * 2
    while high - low > 0.1:
        middle = (low + high) / 2
        low, high = (middle, high) if attained(middle) else (low, middle)
    if low <= 0:
        raise ValueError("no request rate meets the SLO on one replica: is the SLO reachable?")
    return round(low, 1)


def calibration_sizes(
    args: argparse.Namespace, arrivals: list[traces.Arrival] | None
) -> list[tuple[int, int]]:
    """What `--calibrate` sends: `--calibrate-prompt-tokens`/`--calibrate-output-tokens`
    where given, else up to 200 of the trace's requests' sizes (seeded)."""
    prompt, output = args.calibrate_prompt_tokens, args.calibrate_output_tokens
    if prompt is not None and output is not None:
        return [(prompt, output)]
    if not arrivals:
        raise ValueError(
            "--calibrate without --trace needs --calibrate-prompt-tokens and "
            "--calibrate-output-tokens"
        )
    rng = random.Random(f"calibrate-sizes/{args.seed}")
    picked = rng.sample(arrivals, min(200, len(arrivals)))
    return [(prompt or a.prompt_tokens, output or a.output_tokens) for a in picked]


def measure_replica(
    args: argparse.Namespace, slo: api.SLO, arrivals: list[traces.Arrival] | None
) -> calibrate.Calibration:
    """`--calibrate URL`: the replica's capacity at the SLO, measured over HTTP, and the
    simulated profile's step-cost factor that serves the same (the calibrated replica)."""
    sizes = calibration_sizes(args, arrivals)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    measured = asyncio.run(
        calibrate.search(
            args.calibrate,
            sizes,
            slo,
            OBJECTIVE,
            model=args.calibrate_model,
            start_rps=args.calibrate_start,
            seconds=args.calibrate_seconds,
            max_points=args.calibrate_max_points,
            bisections=args.calibrate_bisections,
            request_timeout=args.calibrate_timeout,
            seed=args.seed,
            log=log,
        )
    )
    fitted = measured.sizes

    def simulated(rate: float, factor: float) -> bool:
        return meets(fitted, slo, rate, factor, args.seed)

    measured.slowdown = calibrate.fit_slowdown(measured.capacity_rps, simulated)
    measured.simulated_rps = calibrate.simulated_capacity(
        simulated, measured.slowdown, measured.capacity_rps
    )
    return measured


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The figures (`--json` prints them); the runs are the benchmark's (`experiment.run`)."""
    started = time.perf_counter()
    trace = traces.read_file(args.trace, args.rate_scale, args.seed)
    arrivals = trace.arrivals(args.seed)
    slo = api.SLO(ttft_seconds=args.ttft, itl_seconds=args.itl)
    measured = None
    slowdown = 1.0
    if args.calibrate:
        measured = measure_replica(args, slo, arrivals)
        slowdown = measured.slowdown or 1.0
    calibrated = args.capacity is None
    capacity = (
        calibrate_capacity(arrivals, slo, args.seed, slowdown=slowdown)
        if calibrated
        else args.capacity
    )
    gpu_price = args.gpu_hour_price if args.gpu_hour_price is not None else DEFAULT_GPU_HOUR_PRICE
    gpus = args.tensor_parallel
    api_price = (
        args.api_price_per_million if args.api_price_per_million is not None else DEFAULT_API_PRICE
    )
    model = ApiModel(
        ttft_seconds=args.api_ttft,
        itl_seconds=args.api_itl,
        input_price_per_million=api_price,
        output_price_per_million=api_price,
        max_concurrency=args.api_max_concurrency,
    )
    spec = (
        *getattr(args, "manifest_spec", ()),
        ("min_replicas", args.min_replicas),
        ("max_replicas", args.max_replicas),
    )
    common = {
        "trace_file": str(args.trace),
        "rate_scale": args.rate_scale,
        "seed": args.seed,
        "load_seconds": args.load_seconds,
        "spec": spec,
        "api_model": model,
        "gpu_hour_price": gpu_price * gpus,
        "capacity": capacity,
        "slo": (args.ttft, args.itl),
        "slowdown": slowdown,
    }
    runs, results = {}, {}
    for name in [p for p in args.policies.split(",") if p]:
        summary, result = experiment.run(experiment.Job(trace.name, name, **common))
        runs[name], results[name] = summary, result
    everything, _ = experiment.run(experiment.Job(trace.name, experiment.ALL_API, **common))

    oracle = experiment.oracle_fleet(trace, capacity, args.interval)
    peak = min(args.max_replicas, max(args.min_replicas, experiment.fixed_size_of(trace, capacity)))
    hours = trace.duration / 3600
    mean_prompt = sum(a.prompt_tokens for a in arrivals) / len(arrivals)
    mean_output = sum(a.output_tokens for a in arrivals) / len(arrivals)
    api_per_request = model.cost(mean_prompt, mean_output)
    replica_per_request = gpu_price * gpus / 3600 / capacity  # a busy replica
    ratio = experiment.cost_ratio(arrivals, model, gpu_price, capacity, gpus)
    document: dict[str, Any] = {
        "trace": {
            "file": str(args.trace),
            "requests": len(arrivals),
            "duration_s": round(trace.duration, 1),
            "rate_scale": args.rate_scale,
            "mean_prompt_tokens": round(mean_prompt, 1),
            "mean_output_tokens": round(mean_output, 1),
            "clipped": trace.clipped,
        },
        "replica": {
            "profile": PROFILE + (f" x{slowdown:g} step costs" if slowdown != 1.0 else ""),
            "slowdown": slowdown,
            "gpus": gpus,
            "capacity_rps": capacity,
            "capacity": "calibrated" if calibrated else "given",
            "load_seconds": args.load_seconds,
        },
        "slo": {"ttft_seconds": args.ttft, "itl_seconds": args.itl, "objective": OBJECTIVE},
        "prices": {"gpu_hour": gpu_price, "api_per_million_tokens": api_price},
        "oracle": {
            "interval_s": args.interval,
            "replicas": oracle,
            "replica_hours": round(experiment.oracle_replica_seconds(trace, capacity) / 3600, 3),
        },
        "peak_fleet": {
            "replicas": peak,
            "replica_hours": round(peak * hours, 3),
            "cost": round(peak * hours * gpu_price * gpus, 4),
        },
        "policies": {name: _figures(summary) for name, summary in runs.items()},
        "all_api": _figures(everything),
        "break_even": {
            "replica_cost_per_request_busy": round(replica_per_request, 10),
            "api_cost_per_request": round(api_per_request, 10),
            "utilization": round(replica_per_request / api_per_request, 4)
            if api_per_request > 0
            else None,
            "fallback_cost_ratio": round(ratio, 3),
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if args.pd is not None:
        document["pd"] = plan_pd(args, arrivals)
        document["wall_s"] = round(time.perf_counter() - started, 1)
    if measured is not None:
        document["calibration"] = measured.to_json()
    if args.png is not None:
        _plot(args.png, trace, capacity, oracle, args.interval, results)
        document["png"] = str(args.png)
    return document


def plan_pd(args: argparse.Namespace, arrivals: list[traces.Arrival]) -> dict[str, Any]:
    """`--pd REPLICAS`: P/D on the trace (`pd.plan_trace`: the P/D bench's simulation and
    the gateway's own split rule), on the plan's replica profile at its datasheet costs."""
    profile = PROFILES[PROFILE]
    pool = pd.Pool(PROFILE, args.tensor_parallel, args.pd, profile.kv_bytes_per_token,
                   args.pd_link_gbps * 1e9)  # fmt: skip
    reqs = [pd.Req(a.time, a.prompt_tokens, a.output_tokens) for a in arrivals]
    return pd.plan_trace(reqs, pool, (args.ttft, args.itl))


def _figures(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "replica_hours": round(summary["replica_seconds"] / 3600, 3),
        "replica_seconds": summary["replica_seconds"],
        "cost": summary["cost"],
        "gpu_cost": summary["gpu_cost"],
        "api_cost": summary["api_cost"],
        "slo_attainment": summary["slo_attainment"],
        "fallback_share": summary["fallback_share"],
        "max_replicas": summary["max_replicas"],
        "direction_changes": summary["direction_changes"],
        "fallback_cost_ratio": summary.get("fallback_cost_ratio"),
    }


def calibration_lines(calibration: dict[str, Any] | None) -> list[str]:
    """What `--calibrate` measured, for the text output."""
    if not calibration:
        return []
    points = ", ".join(f"{p['rate']:g}: {p['attainment']:.1%}" for p in calibration["points"])
    return [
        f"calibrated: {calibration['url']} ({calibration['model']}) serves "
        + ("" if calibration["bounded"] else "at least (no rate tried missed) ")
        + f"{calibration['capacity_rps']:g} req/s of the requests sent with "
        f"{calibration['objective']:.0%} within the SLO (req/s: SLO met {points});",
        f"  the simulated replica serves as much at x{calibration['slowdown']:g} its step costs "
        f"({calibration['simulated_rps']:g} req/s of the same requests)",
    ]


def text(document: dict[str, Any]) -> str:
    t, r, o, peak = (
        document["trace"],
        document["replica"],
        document["oracle"],
        document["peak_fleet"],
    )
    slo, prices, even = document["slo"], document["prices"], document["break_even"]
    lines = [
        f"trace: {t['file']}: {t['requests']:,} requests over {t['duration_s']:,.0f} s "
        f"(x{t['rate_scale']:g}), mean {t['mean_prompt_tokens']:,.0f} prompt / "
        f"{t['mean_output_tokens']:,.0f} output tokens",
        f"replica: {r['profile']} (simulated) x {r['gpus']} GPU, serves {r['capacity_rps']:g} "
        f"req/s of these requests within TTFT <= {slo['ttft_seconds']:g} s and ITL <= "
        f"{slo['itl_seconds']:g} s ({r['capacity']}); {r['load_seconds']:g} s to load",
        f"prices: ${prices['gpu_hour']:g} per GPU-hour, API ${prices['api_per_million_tokens']:g} "
        "per million tokens",
        *calibration_lines(document.get("calibration")),
        "",
        f"oracle fleet (replicas needed per {o['interval_s']:g} s, instant replicas): "
        + " ".join(str(n) for n in o["replicas"])
        + f"; {o['replica_hours']:.2f} replica-h",
        f"peak fleet: {peak['replicas']} replicas all along, {peak['replica_hours']:.2f} "
        f"replica-h, ${peak['cost']:.2f}",
        "",
    ]
    rows = [("", "replica-h", "cost $", "SLO met", "fallback", "max rep")]
    for name, f in document["policies"].items():
        rows.append((LABELS[name], f"{f['replica_hours']:.2f}", f"{f['cost']:.2f}",
                     f"{f['slo_attainment']:.2%}", f"{f['fallback_share']:.1%}",
                     str(f["max_replicas"])))  # fmt: skip
    a = document["all_api"]
    rows.append(("all requests at the API", "0", f"{a['cost']:.2f}", f"{a['slo_attainment']:.2%}",
                 "100%", "0"))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    utilization = even["utilization"]
    lines += [
        "",
        f"break-even: a busy replica costs ${even['replica_cost_per_request_busy']:.6f} a request, "
        f"the API ${even['api_cost_per_request']:.6f}: "
        + (
            f"a replica is cheaper above {utilization:.0%} utilisation"
            if utilization is not None and utilization <= 1
            else "the API is cheaper at any utilisation"
        ),
        f"spec.autoscaling.fallbackCostRatio for these prices and requests: "
        f"{even['fallback_cost_ratio']:g} (modelLoadSeconds: {r['load_seconds']:g})",
    ]
    if "pd" in document:
        lines += ["", *pd.plan_lines(document["pd"])]
    if "png" in document:
        lines.append(f"wrote {document['png']}")
    lines.append(f"simulated in {document['wall_s']:g} s")
    return "\n".join(lines)


def _plot(
    path: Path,
    trace: traces.Trace,
    capacity: float,
    oracle: list[int],
    interval: float,
    results: dict[str, Any],
) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--png needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    seconds = range(0, int(trace.duration), 10)
    ax.plot(list(seconds), [trace.rate(float(s)) / capacity for s in seconds], color="0.6",
            lw=0.8, label="load (replicas' worth, per minute)")  # fmt: skip
    edges = [i * interval for i in range(len(oracle))]
    ax.step(edges, oracle, where="post", color="k", ls="--", lw=0.8,
            label=f"oracle fleet (per {interval:g} s)")  # fmt: skip
    for name, result in results.items():
        ax.step([s.time for s in result.samples],
                [s.ready + s.starting for s in result.samples], where="post", lw=1.0,
                label=LABELS.get(name, name))  # fmt: skip
    ax.set_xlabel("seconds into the trace")
    ax.set_ylabel("replicas")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    """`kubellm plan --trace`: the parsed arguments of `kubellm plan` (kubellm/cli.py)."""
    if getattr(args, "filename", None):
        try:
            args.manifest_spec = _from_manifest(args)
        except manifests.ManifestError as error:
            return _fail(str(error))
        except ValueError as error:
            return _fail(str(error))
    _defaults(args)
    problem = _check(args)
    if problem:
        return _fail(problem)
    if not args.trace:  # --calibrate alone: the measured replica, no plan
        try:
            slo = api.SLO(ttft_seconds=args.ttft, itl_seconds=args.itl)
            measured = measure_replica(args, slo, None)
        except ValueError as error:
            return _fail(str(error))
        document = {"calibration": measured.to_json()}
        print(
            json.dumps(document)
            if args.json
            else "\n".join(calibration_lines(document["calibration"]))
        )
        return 0
    try:
        document = plan(args)
    except traces.TraceError as error:
        return _fail(f"--trace: {error}")
    except ValueError as error:
        return _fail(str(error))
    if args.json:
        print(json.dumps(document))
    else:
        print(text(document))
    return 0 if all(math.isfinite(f["cost"]) for f in document["policies"].values()) else 1
