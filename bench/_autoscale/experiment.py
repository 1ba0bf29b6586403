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
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kubellm.autoscaler import kvqueue
from kubellm.autoscaler import policy as policies
from kubellm.autoscaler.concurrency import ConcurrencyPolicy
from kubellm.engine import sim_profiles

from kubellm import api

from . import traces
from .fleet import Fleet, FleetConfig, Result

# Requests/s one replica serves with >= 99% SLO attainment, per request mix
# (`calibrate`; the cliff is just above: long 8.5 and short 26 req/s are overloaded).
CAPACITY_RPS = {"long": 7.0, "short": 20.0}
LOAD_SECONDS = 60.0
RATE_TARGET = 0.8  # targetRequestsPerReplica as a share of CAPACITY_RPS
PERIOD = 5.0
POLICIES = ("kv-queue", "concurrency", "fixed")  # the comparison, run by default
TRACES = ("step", "ramp", "bursty-day")


def profile() -> sim_profiles.Profile:
    return sim_profiles.get("llama-3.1-8b-h100").with_overrides(
        max_num_seqs=128, max_num_batched_tokens=2048, prefix_caching=False
    )


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
    **overrides: Any,
) -> FleetConfig:
    return FleetConfig(
        profile=profile(),
        autoscaling=autoscaling(mix, **overrides),
        slo=api.SLO(),
        initial_replicas=initial_replicas,
        load_seconds=load_seconds,
        period=PERIOD,
    )


def make_trace(name: str, mix: str = "long", scale: float = 1.0, seed: int = 0) -> traces.Trace:
    capacity = CAPACITY_RPS[mix]
    if name == "step":
        return traces.step(capacity, scale)
    if name == "ramp":
        return traces.ramp(capacity, scale)
    if name == "bursty-day":
        return traces.bursty_day(capacity, scale, seed)
    raise ValueError(f"--traces: unknown trace {name!r}; known: {', '.join(TRACES)}")


def peak_rate(trace: traces.Trace) -> float:
    """The highest rate of the curve, sampled every simulated second."""
    return max(trace.rate(float(t)) for t in range(int(trace.duration) + 1))


def fixed_size(trace: traces.Trace, mix: str) -> int:
    return math.ceil(peak_rate(trace) / CAPACITY_RPS[mix] - 1e-9)


def oracle_replica_seconds(trace: traces.Trace, mix: str) -> float:
    """A lower bound: replicas appear instantly, ceil(rate / capacity) of them, every second."""
    capacity = CAPACITY_RPS[mix]
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
    if name == "fixed":
        return None
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


def run(job: Job) -> tuple[dict[str, Any], Result]:
    """One (trace, policy) run: its summary and its full result (for the plot)."""
    trace = make_trace(job.trace, job.mix, job.scale, job.seed)
    initial = fixed_size(trace, job.mix) if job.policy == "fixed" else 1
    fleet = Fleet(
        config(initial, job.load_seconds, job.mix, **dict(job.spec)),
        make_policy(job.policy, job.kpa_target, CAPACITY_RPS[job.mix]),
        trace.arrivals(job.seed, traces.MIXES[job.mix]),
        trace.duration,
        trace=job.trace,
        policy_name=job.policy,
    )
    started = time.perf_counter()
    result = fleet.run()
    summary = summarise(result, autoscaling(**dict(job.spec)).scale_down_stabilization_seconds)
    summary["wall_s"] = round(time.perf_counter() - started, 2)
    summary["trace_description"] = trace.description
    summary["oracle_replica_seconds"] = oracle_replica_seconds(trace, job.mix)
    spec = autoscaling(job.mix, **dict(job.spec))
    summary["target_requests_per_replica"] = spec.target_requests_per_replica
    summary["scale_down_stabilization_seconds"] = spec.scale_down_stabilization_seconds
    for key, held in (
        ("rate_rule_replica_seconds", False),
        ("rate_rule_held_replica_seconds", True),
    ):
        summary[key] = rate_rule_replica_seconds(trace, spec, held)
    summary["mix"] = job.mix
    return summary, result


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
