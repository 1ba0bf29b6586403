"""The experiment: which fleet, which policies, which traces, and the figures per run.

Fleet: `llama-3.1-8b-h100` (Llama 3.1 8B bf16 on one 80 GB GPU) with the
batching limits of examples/llama-3.1-8b-gpu.yaml (maxNumSeqs 128,
maxNumBatchedTokens 2048, chunked prefill). Prefix caching is switched off in
the simulated engines: the traces share no prefixes, so it changes no
timing, and hashing every prompt block would triple the simulation's cost.
Autoscaling spec: the example's (1..8 replicas, KV target 0.8, queue target
4 per replica, scale up at once, scale down after 300 s of agreement).
SLO: the API defaults, TTFT <= 2 s and mean ITL <= 0.1 s per request.

Capacity: one replica serves `CAPACITY_RPS` requests/s of the trace's request
mix with >= 99% SLO attainment (`calibrate` checks it; at 26 req/s it is
already overloaded). Traces are written in multiples of it; the fixed fleet
is ceil(peak rate / capacity) replicas; the KPA-style policy's target
concurrency is the in-flight requests one replica holds at that rate, so it
is sized by the same rule of thumb as the fixed fleet.

Cost: replica-seconds (starting to drained: a GPU is paid while it loads)
at `GPU_HOUR_PRICE` per hour, plus the prompt and output tokens the fallback
API served at its prices (`gateway.ApiModel`). kv-queue+fallback runs with
targetRequestsPerReplica at the full capacity (`FALLBACK_RATE_TARGET`): the
headroom kv-queue keeps for spikes is what the fallback is for.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubellm import api
from kubellm.autoscaler import kvqueue
from kubellm.autoscaler import policy as policies
from kubellm.autoscaler.concurrency import ConcurrencyPolicy
from kubellm.engine import sim_profiles

from . import traces
from .fleet import Fleet, FleetConfig, Result, Sample
from .gateway import ApiModel

# Requests/s one replica serves with >= 99% SLO attainment, per request mix
# (`calibrate`; the cliff is just above: long 8.5 and short 26 req/s are overloaded).
CAPACITY_RPS = {"long": 7.0, "short": 20.0}
LOAD_SECONDS = 60.0
RATE_TARGET = 0.8  # targetRequestsPerReplica as a share of CAPACITY_RPS
# With the fallback: the full capacity. Headroom is there for spikes that arrive faster than a
# model loads; with a fallback, the fallback takes them (and the overflow while replicas load).
FALLBACK_RATE_TARGET = 1.0
PERIOD = 5.0
FALLBACK = "kv-queue+fallback"  # kv-queue, with the gateway's admission and the fallback API
# The same, with spec.autoscaling.fallbackCostRatio set from the run's prices and trace (the
# cost rule: overflow waits at the fallback, scale-down holds, by what each costs).
COST = "kv-queue+fallback+cost"
# What a platform team gets with a fallback and nothing else set: kv-queue with the spec's
# own defaults (targetRequestsPerReplica unset: derived from what saturated replicas answer,
# maxFallbackShare 0.05); the benchmark's first row.
DEFAULTS = "defaults"
FALLBACK_POLICIES = (DEFAULTS, FALLBACK, COST)
ALL_API = "all-api"  # no fleet: every request goes to the API
# The comparison, run by default.
POLICIES = (DEFAULTS, "fixed", "concurrency", "kv-queue", FALLBACK, COST, ALL_API)
# A kv-queue policy name with this suffix runs with spec.autoscaling.predictive (the trend
# forecast one model load ahead, `kubellm.autoscaler.forecast`); on request only.
PREDICT = "+predict"
PREDICTIVE_POLICIES = tuple(f"{name}{PREDICT}" for name in ("kv-queue", FALLBACK, COST))
KNOWN_POLICIES = (*POLICIES, *PREDICTIVE_POLICIES)


def base_policy(name: str) -> tuple[str, bool]:
    """A policy name without the predictive suffix, and whether it had one."""
    return (name.removesuffix(PREDICT), True) if name in PREDICTIVE_POLICIES else (name, False)


TRACES = ("step", "ramp", "bursty-day")
EXTRA_TRACES = ("compressed-day", "bursty-hour", "smooth-hour")  # on request only
# compressed-day: issue #6's day (mixed time scales); bursty-hour, smooth-hour: generated
# hours shaped like the Azure code and conversation traces superposed x8 (issue #31)
GPU_HOUR_PRICE = 2.50  # $ per GPU-hour: an 80 GB H100 rented on demand


def profile(slowdown: float = 1.0) -> sim_profiles.Profile:
    """The simulated replica; `slowdown` multiplies every step cost (a replica calibrated
    against a real engine, `kubellm plan --calibrate`)."""
    base = sim_profiles.get("llama-3.1-8b-h100").with_overrides(
        max_num_seqs=128, max_num_batched_tokens=2048, prefix_caching=False
    )
    return base if slowdown == 1.0 else base.slowed(slowdown)


def autoscaling(mix: str = "long", **overrides: Any) -> api.Autoscaling:
    """The example's spec.autoscaling; `overrides` by field name (what-if runs).

    targetRequestsPerReplica: `RATE_TARGET` of what one replica serves within
    the SLO, the headroom the KV target (0.8) gives the pool.
    """
    fields: dict[str, Any] = {
        "min_replicas": 1,
        "max_replicas": 8,
        "target_kv_cache_usage": 0.8,
        "target_queue_depth": 4,
        "scale_up_stabilization_seconds": 0,
        "scale_down_stabilization_seconds": 300,
        "target_requests_per_replica": round(RATE_TARGET * CAPACITY_RPS[mix], 2),
    }
    fields.update(overrides)
    return api.Autoscaling(**fields)


def config(
    initial_replicas: int = 1,
    load_seconds: float = LOAD_SECONDS,
    mix: str = "long",
    fallback: ApiModel | None = None,
    slo: api.SLO | None = None,
    slowdown: float = 1.0,
    **overrides: Any,
) -> FleetConfig:
    return FleetConfig(
        profile=profile(slowdown),
        autoscaling=autoscaling(mix, **overrides),
        slo=slo or api.SLO(),
        initial_replicas=initial_replicas,
        load_seconds=load_seconds,
        period=PERIOD,
        fallback=fallback,
    )


def make_trace(name: str, mix: str = "long", scale: float = 1.0, seed: int = 0) -> traces.Trace:
    capacity = CAPACITY_RPS[mix]
    if name == "step":
        return traces.step(capacity, scale)
    if name == "ramp":
        return traces.ramp(capacity, scale)
    if name == "bursty-day":
        return traces.bursty_day(capacity, scale, seed)
    if name == "compressed-day":
        return traces.compressed_day(capacity, scale, seed)
    if name == "bursty-hour":
        return traces.bursty_hour(capacity, scale, seed)
    if name == "smooth-hour":
        return traces.smooth_hour(capacity, scale, seed)
    known = ", ".join((*TRACES, *EXTRA_TRACES))
    raise ValueError(f"--traces: unknown trace {name!r}; known: {known}")


def peak_rate(trace: traces.Trace) -> float:
    """The highest rate of the curve, sampled every simulated second."""
    return max(trace.rate(float(t)) for t in range(int(trace.duration) + 1))


def capacity_rps(mix: str | float) -> float:
    """One replica's requests/s within the SLO: a mix's (`CAPACITY_RPS`), or a figure."""
    return float(mix) if not isinstance(mix, str) else CAPACITY_RPS[mix]


def fixed_size(trace: traces.Trace, mix: str | float) -> int:
    return math.ceil(peak_rate(trace) / capacity_rps(mix) - 1e-9)


def oracle_fleet(trace: traces.Trace, capacity: float, interval: float) -> list[int]:
    """Replicas the load needs per `interval` (instant replicas): the largest
    ceil(rate / capacity) of its seconds, at least one."""
    out: list[int] = []
    start = 0.0
    # a last interval of under 5% of one (a recorded trace ends a second after its last
    # request) is the previous interval's tail
    while start < trace.duration and not (out and trace.duration - start < 0.05 * interval):
        seconds = range(int(start), int(min(trace.duration, start + interval)))
        need = max((math.ceil(trace.rate(t + 0.5) / capacity - 1e-9) for t in seconds), default=0)
        out.append(max(1, need))
        start += interval
    return out


def oracle_replica_seconds(trace: traces.Trace, mix: str | float) -> float:
    """A lower bound: replicas appear instantly, ceil(rate / capacity) of them, every second."""
    capacity = capacity_rps(mix)
    return float(
        sum(
            max(1, math.ceil(trace.rate(t + 0.5) / capacity - 1e-9))
            for t in range(int(trace.duration))
        )
    )


def rate_rule_replica_seconds(
    trace: traces.Trace, spec: api.Autoscaling, held: bool, period: float = PERIOD
) -> float | None:
    """A reference, not a bound: replicas that appear instantly, at what the rate signal asks.

    Every `period` the replica count becomes kv-queue's rate ask for the
    trace's exact rate (`ceil(rate / targetRequestsPerReplica)`, the 10%
    tolerance against the current count, at least minReplicas); with `held`,
    scale-down waits for scaleDownStabilizationSeconds as the policy's does
    (the largest ask of the window). No model load, no Poisson noise, no
    queue or KV signal. None without targetRequestsPerReplica.
    """
    per_replica = spec.target_requests_per_replica
    if per_replica is None:
        return None
    tolerance = kvqueue.KVQueuePolicy().tolerance
    window = spec.scale_down_stabilization_seconds if held else 0.0
    replicas, asks, total, t = max(1, spec.min_replicas), [], 0.0, 0.0
    while t < trace.duration:
        ask = kvqueue._ask(trace.rate(t), per_replica, replicas, tolerance)
        ask = min(spec.max_replicas, max(spec.min_replicas, 1, ask))
        asks = [(s, a) for s, a in asks if s > t - window] + [(t, ask)]
        replicas = ask if ask >= replicas else max(a for _, a in asks)
        total += replicas * min(period, trace.duration - t)
        t += period
    return total


def calibrate(mix: str, rate: float | None = None, seconds: float = 120.0) -> dict[str, float]:
    """One replica at a constant rate (default: the mix's capacity): attainment, in-flight."""
    rate = CAPACITY_RPS[mix] if rate is None else rate
    trace = traces.Trace("calibrate", seconds, lambda t: rate, rate, f"{rate:g} req/s")
    result = Fleet(config(mix=mix), None, trace.arrivals(0, traces.MIXES[mix]), seconds).run()
    return {
        "mix": mix,
        "rate": rate,
        "kv_cache_usage": statistics.fmean(s.kv_cache_usage for s in result.samples),
        "slo_attainment": result.met / result.requests,
        "concurrency": statistics.fmean(s.waiting + s.running for s in result.samples),
    }


def make_policy(name: str, kpa_target: float, capacity: float) -> policies.Policy | None:
    if name in ("fixed", ALL_API):
        return None
    if name in FALLBACK_POLICIES:
        return policies.get("kv-queue")
    if name == "concurrency":
        return ConcurrencyPolicy(target_concurrency=kpa_target)
    return policies.get(name)


@dataclass(frozen=True)
class Job:
    trace: str
    policy: str
    mix: str = "long"
    seed: int = 0
    scale: float = 1.0
    kpa_target: float = 32.0
    load_seconds: float = LOAD_SECONDS
    spec: tuple[tuple[str, Any], ...] = ()  # spec.autoscaling overrides (field, value)
    api_model: ApiModel = field(default_factory=ApiModel)
    gpu_hour_price: float = GPU_HOUR_PRICE
    fallback_share: float | None = None  # maxFallbackShare for this run (None: the spec's)
    trace_file: str | None = None  # a CSV (or JSONL) trace instead of a built-in one
    rate_scale: float = 1.0
    # one replica's requests/s within the SLO (None: the mix's CAPACITY_RPS); sets the
    # fixed fleet, the oracle and targetRequestsPerReplica (RATE_TARGET x, or the full rate
    # with the fallback) unless the spec overrides it
    capacity: float | None = None
    slo: tuple[float, float] | None = None  # (TTFT, ITL) seconds (None: spec.slo's defaults)
    slowdown: float = 1.0  # every simulated step cost x this (a calibrated replica)

    @property
    def label(self) -> str:
        """The policy's name in the table: the knob's value where it differs from the spec's."""
        if self.policy == FALLBACK and self.fallback_share is not None:
            return f"{FALLBACK} share={self.fallback_share:g}"
        return self.policy


def load_trace(job: Job) -> traces.Trace:
    if job.trace_file:
        return traces.read_file(Path(job.trace_file), job.rate_scale, job.seed)
    return make_trace(job.trace, job.mix, job.scale, job.seed)


def fixed_size_of(trace: traces.Trace, mix: str | float) -> int:
    if isinstance(trace, traces.RecordedTrace):
        return max(1, math.ceil(trace.peak_rate / capacity_rps(mix) - 1e-9))
    return fixed_size(trace, mix)


def run(job: Job) -> tuple[dict[str, Any], Result]:
    """One (trace, policy) run: its summary and its full result (for the plot)."""
    trace = load_trace(job)
    arrivals = trace.arrivals(job.seed, traces.MIXES[job.mix])
    capacity = job.capacity or CAPACITY_RPS[job.mix]
    overrides = dict(job.spec)
    name, predictive = base_policy(job.policy)
    if predictive:
        overrides["predictive"] = True
        overrides.setdefault("model_load_seconds", round(job.load_seconds))
    if job.capacity is not None:
        overrides.setdefault("target_requests_per_replica", round(RATE_TARGET * capacity, 2))
    if job.fallback_share is not None:
        overrides["max_fallback_share"] = job.fallback_share
    if name in FALLBACK_POLICIES and "target_requests_per_replica" not in dict(job.spec):
        target = None if name == DEFAULTS else round(FALLBACK_RATE_TARGET * capacity, 2)
        overrides["target_requests_per_replica"] = target
    if name in (DEFAULTS, FALLBACK):
        overrides["fallback_cost_ratio"] = None  # the share rule, whatever the spec says
    if name == COST:
        overrides.setdefault("model_load_seconds", round(job.load_seconds))
        if overrides.get("fallback_cost_ratio") is None:
            per_replica = autoscaling(job.mix, **overrides).target_requests_per_replica
            per_replica = per_replica or capacity  # derived (unset): what a replica serves
            ratio = cost_ratio(arrivals, job.api_model, job.gpu_hour_price, per_replica)
            # free GPUs (a zero price): no finite ratio, the share rule decides; a free API: the
            # least ratio the spec takes (an overflow never adds a replica)
            overrides["fallback_cost_ratio"] = (
                max(0.001, round(ratio, 3)) if math.isfinite(ratio) else None
            )
    spec = autoscaling(job.mix, **overrides)
    slo = api.SLO() if job.slo is None else api.SLO(ttft_seconds=job.slo[0], itl_seconds=job.slo[1])
    started = time.perf_counter()
    if name == ALL_API:
        result = all_api(arrivals, trace.duration, job.api_model, slo, trace.name)
    else:
        initial = (
            fixed_size_of(trace, capacity)
            if name == "fixed"
            else warm_start(arrivals, spec, capacity)
        )
        fleet = Fleet(
            config(
                initial,
                job.load_seconds,
                job.mix,
                fallback=job.api_model if name in FALLBACK_POLICIES else None,
                slo=slo,
                slowdown=job.slowdown,
                **overrides,
            ),
            make_policy(name, job.kpa_target, capacity),
            arrivals,
            trace.duration,
            trace=trace.name,
            policy_name=job.label,
        )
        result = fleet.run()
    summary = summarise(result, spec.scale_down_stabilization_seconds)
    summary["wall_s"] = round(time.perf_counter() - started, 2)
    summary["trace_description"] = trace.description
    summary["oracle_replica_seconds"] = oracle_replica_seconds(trace, capacity)
    summary["target_requests_per_replica"] = spec.target_requests_per_replica
    summary["scale_down_stabilization_seconds"] = spec.scale_down_stabilization_seconds
    summary["max_fallback_share"] = spec.max_fallback_share if name in FALLBACK_POLICIES else None
    summary["fallback_cost_ratio"] = spec.fallback_cost_ratio
    summary["predictive"] = spec.predictive
    for key, held in (
        ("rate_rule_replica_seconds", False),
        ("rate_rule_held_replica_seconds", True),
    ):
        summary[key] = rate_rule_replica_seconds(trace, spec, held)
    summary["mix"] = job.mix
    summary["capacity_rps"] = capacity
    summary.update(costs(result, job.api_model, job.gpu_hour_price))
    summary["breakdown"] = breakdown(result, trace, capacity, spec.min_replicas)
    # The step's reflex with a fallback: the gateway sends the overflow there, so no queue
    # need form at the replicas; what counts is how soon after the step a replica is added.
    if job.trace == "step" and not job.trace_file:
        step_at = traces.STEP_AT * job.scale
        ups = [t for t, a, b, _ in result.decisions if b > a and t >= step_at]
        summary["step_to_scale_up_s"] = round(ups[0] - step_at, 3) if ups else None
    return summary, result


WARM_START_SECONDS = 60.0


def warm_start(arrivals: Sequence[traces.Arrival], spec: api.Autoscaling, capacity: float) -> int:
    """The fleet a run starts with: what the rate signal asks for the first minute's
    arrivals (`ceil(rate / targetRequestsPerReplica)`, else the capacity), within
    min..maxReplicas and at least one. A trace is a cut from traffic that was already
    flowing: a fleet of one facing five replicas' load at t=0 measures a cold start, not
    the autoscaler (the step, the ramp and the bursty day start under one replica's worth:
    one replica, as before)."""
    per_replica = spec.target_requests_per_replica or capacity
    first = sum(1 for a in arrivals if a.time < WARM_START_SECONDS) / WARM_START_SECONDS
    need = math.ceil(first / per_replica - 1e-9)
    return min(spec.max_replicas, max(spec.min_replicas, 1, need))


def cost_ratio(
    arrivals: Sequence[traces.Arrival],
    model: ApiModel,
    gpu_hour_price: float,
    per_replica: float | None,
    gpus_per_replica: int = 1,
) -> float:
    """spec.autoscaling.fallbackCostRatio for a trace and prices: what the fallback API
    charges per second for one replica's load (`per_replica` requests/s of the trace's
    mean request) over what one replica costs per second."""
    if not arrivals or not per_replica:
        raise ValueError("cost ratio: needs requests and a per-replica rate")
    prompt = sum(a.prompt_tokens for a in arrivals) / len(arrivals)
    output = sum(a.output_tokens for a in arrivals) / len(arrivals)
    replica_per_second = gpu_hour_price * gpus_per_replica / 3600
    if replica_per_second <= 0:
        return math.inf
    return per_replica * model.cost(prompt, output) / replica_per_second


def all_api(
    arrivals: Sequence[traces.Arrival], duration: float, model: ApiModel, slo: api.SLO, trace: str
) -> Result:
    """Every request served by the API: its modelled latency, no queue, no replica."""
    result = Result(trace, ALL_API, duration, requests=len(arrivals))
    meets = model.ttft_seconds <= slo.ttft_seconds and model.itl_seconds <= slo.itl_seconds
    per_period: dict[int, int] = {}
    for a in arrivals:
        result.finished += 1
        result.fallback_requests += 1
        result.fallback_prompt_tokens += a.prompt_tokens
        result.fallback_output_tokens += a.output_tokens
        result.ttft.append(model.ttft_seconds)
        result.itl.append(model.itl_seconds)
        if meets:
            result.met += 1
        else:
            result.missed.append(a.time)
        per_period[int(a.time // PERIOD)] = per_period.get(int(a.time // PERIOD), 0) + 1
    for k in range(1, int(duration // PERIOD) + 1):
        count = per_period.get(k - 1, 0)
        result.samples.append(
            Sample(k * PERIOD, count / PERIOD, 0, 0, 0, 0, 0, 0, 0.0, None, fallback=count)
        )
    return result


def breakdown(
    result: Result,
    trace: traces.Trace,
    mix: str | float,
    min_replicas: int,
    period: float = PERIOD,
) -> dict[str, Any]:
    """Where the replica-seconds go, from the fleet sampled every control period.

    Per sample, against what the load needs (`ceil(rate / capacity)` at the
    trace's exact rate, at least minReplicas: the oracle's count): replicas
    loading weights, draining, ready up to the need ("needed"), and ready
    above it ("headroom": held by the scale-down window, the rate's noise,
    or a spike's scale-up). "short" is the need not covered by ready
    replicas (the fallback or a queue took it). Per hour of the trace too.
    The figures are sampled (the fleet after each tick's decision, for the
    period that follows; the first period is not sampled), so their sum
    differs a little from the exact replica-seconds.
    """
    capacity = capacity_rps(mix)
    keys = ("loading", "draining", "needed", "headroom", "short")
    total = dict.fromkeys(keys, 0.0)
    hours: list[dict[str, float]] = []
    for s in result.samples:
        start = s.time  # taken after the period's decision: the fleet for [start, + period)
        if start >= trace.duration:
            continue
        span = min(period, trace.duration - start)
        need = max(min_replicas, 1, math.ceil(trace.rate(start + span / 2) / capacity - 1e-9))
        figures = {
            "loading": s.starting * span,
            "draining": s.draining * span,
            "needed": min(s.ready, need) * span,
            "headroom": max(0, s.ready - need) * span,
            "short": max(0, need - s.ready) * span,
        }
        hour = int(start // 3600)
        while len(hours) <= hour:
            hours.append(dict.fromkeys(keys, 0.0))
        for key, value in figures.items():
            total[key] += value
            hours[hour][key] += value
    return {**total, "per_hour": hours}


def costs(result: Result, model: ApiModel, gpu_hour_price: float) -> dict[str, Any]:
    """GPU-hours at their price plus the tokens the API served at its prices."""
    gpu = result.replica_seconds / 3600 * gpu_hour_price
    api_cost = model.cost(result.fallback_prompt_tokens, result.fallback_output_tokens)
    return {
        "fallback_requests": result.fallback_requests,
        "fallback_share": round(result.fallback_requests / result.requests, 5)
        if result.requests
        else None,
        "fallback_tokens": result.fallback_prompt_tokens + result.fallback_output_tokens,
        "fallback_prompt_tokens": result.fallback_prompt_tokens,
        "fallback_output_tokens": result.fallback_output_tokens,
        "rejected": result.rejected,
        "gpu_cost": round(gpu, 4),
        "api_cost": round(api_cost, 4),
        "cost": round(gpu + api_cost, 4),
    }


def direction_changes(decisions: Sequence[tuple[float, int, int, str]]) -> list[float]:
    """Times at which a scaling decision went the other way from the previous one."""
    changes, last = [], 0
    for t, before, after, _ in decisions:
        sign = 1 if after > before else -1
        if last and sign != last:
            changes.append(t)
        last = sign
    return changes


def max_in_window(times: Sequence[float], window: float) -> int:
    """The most of `times` that fall in any window of `window` seconds."""
    best, start = 0, 0
    for end, t in enumerate(times):
        while times[start] < t - window:
            start += 1
        best = max(best, end - start + 1)
    return best


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def _per_minute(times: Sequence[float], duration: float) -> list[int]:
    counts = [0] * math.ceil(duration / 60)
    for t in times:
        counts[min(len(counts) - 1, int(t // 60))] += 1
    return counts


def summarise(result: Result, window: float) -> dict[str, Any]:
    changes = direction_changes(result.decisions)
    resolved = [d - s for s, d in result.queue_episodes if d is not None]
    return {
        "trace": result.trace,
        "policy": result.policy,
        "duration_s": result.duration,
        "requests": result.requests,
        "finished": result.finished,
        "slo_met": result.met,
        "slo_attainment": round(result.met / result.requests, 5) if result.requests else None,
        "goodput_rps": round(result.met / result.duration, 3),
        "replica_seconds": round(result.replica_seconds, 1),
        "mean_replicas": round(result.replica_seconds / result.duration, 3),
        "max_replicas": result.max_replicas,
        "ttft_p50_s": _pct(result.ttft, 0.50),
        "ttft_p95_s": _pct(result.ttft, 0.95),
        "ttft_p99_s": _pct(result.ttft, 0.99),
        "itl_p95_s": _pct(result.itl, 0.95),
        "scale_ups": sum(1 for _, a, b, _ in result.decisions if b > a),
        "scale_downs": sum(1 for _, a, b, _ in result.decisions if b < a),
        "direction_changes": len(changes),
        "max_direction_changes_per_scale_down_window": max_in_window(changes, window),
        "queue_episodes": len(result.queue_episodes),
        "first_queue_to_scale_up_s": round(resolved[0], 3) if resolved else None,
        "max_queue_to_scale_up_s": round(max(resolved), 3) if resolved else None,
        "queue_episodes_without_scale_up": len(result.queue_episodes) - len(resolved),
        "missed_by_arrival_minute": _per_minute(result.missed, result.duration),
        "decisions": [
            {"time_s": t, "from": a, "to": b, "message": m} for t, a, b, m in result.decisions
        ],
    }
