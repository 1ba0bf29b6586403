"""Seeded request traces for the fleet simulation: a step, a ramp and a bursty day.

A trace is a rate curve (requests per simulated second, in units of one
replica's capacity) sampled into arrivals by thinning a Poisson process, so
the same seed always gives the same requests. Sizes come from a `Mix`
(lognormal prompt and output lengths), the same for every trace; each prompt
is unique (no shared prefix, so routing is load-only and the prefix cache
plays no part). The simulation's cost is per generated token, so outputs are
kept to a few hundred tokens.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Mix:
    """Request sizes: lognormal prompt and output lengths (medians, clipped to a range)."""

    name: str
    prompt_median: int
    prompt_range: tuple[int, int]
    output_median: int
    output_range: tuple[int, int]
    sigma: float = 0.6

    def sample(self, rng: random.Random) -> tuple[int, int]:
        prompt = rng.lognormvariate(math.log(self.prompt_median), self.sigma)
        output = rng.lognormvariate(math.log(self.output_median), self.sigma)
        return (
            int(min(self.prompt_range[1], max(self.prompt_range[0], prompt))),
            int(min(self.output_range[1], max(self.output_range[0], output))),
        )


MIXES = {
    # long chat turns / RAG: the KV pool fills before compute saturates (the design's premise)
    "long": Mix("long", 2400, (256, 6144), 200, (16, 1024)),
    # short requests: compute-bound (prefill); the KV pool stays nearly empty
    "short": Mix("short", 800, (64, 4096), 40, (4, 256)),
}


@dataclass(frozen=True)
class Arrival:
    time: float  # simulated seconds from the trace start
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    """A named rate curve over [0, duration) and its seeded arrivals."""

    name: str
    duration: float
    rate: Callable[[float], float]  # requests per second at time t
    peak_rate: float  # an upper bound of `rate`, for thinning and fleet sizing
    description: str

    def arrivals(self, seed: int, mix: Mix = MIXES["long"]) -> list[Arrival]:
        rng = random.Random(f"{self.name}/{seed}")
        out: list[Arrival] = []
        t = 0.0
        while True:
            t += rng.expovariate(self.peak_rate)
            if t >= self.duration:
                return out
            if rng.random() * self.peak_rate <= self.rate(t):
                out.append(Arrival(t, *mix.sample(rng)))


def step(capacity: float, scale: float = 1.0) -> Trace:
    """Half a replica's load, then 3.5 replicas' worth at once: the scale-up reflex."""
    before, duration = 120.0 * scale, 480.0 * scale
    low, high = 0.5 * capacity, 3.5 * capacity
    return Trace(
        "step",
        duration,
        lambda t: low if t < before else high,
        high,
        f"{low:g} req/s, then {high:g} req/s from t={before:g} s",
    )


def ramp(capacity: float, scale: float = 1.0) -> Trace:
    """From 0.3 to 4 replicas' worth over 60% of the run, hold, then back down."""
    duration = 720.0 * scale
    up, hold = 0.6 * duration, 0.8 * duration
    low, high = 0.3 * capacity, 4.0 * capacity

    def rate(t: float) -> float:
        if t < up:
            return low + (high - low) * t / up
        if t < hold:
            return high
        return high - (high - low) * (t - hold) / (duration - hold)

    return Trace("ramp", duration, rate, high, f"{low:g} -> {high:g} req/s -> {low:g}")


def bursty_day(capacity: float, scale: float = 1.0, seed: int = 0) -> Trace:
    """A diurnal curve (night trough 0.4, afternoon peak 3 replicas' worth) plus spikes.

    24 hours compressed into `1440 x scale` simulated seconds (one minute per
    simulated second at scale 1). Four spikes add 1.5 replicas' worth for
    60-120 s each, at seeded times during the day.
    """
    duration = 1440.0 * scale
    rng = random.Random(f"spikes/{seed}")
    spikes = []
    for _ in range(4):
        start = rng.uniform(0.15, 0.85) * duration
        spikes.append((start, start + rng.uniform(60.0, 120.0) * scale))
    base_low, base_high, spike = 0.4 * capacity, 3.0 * capacity, 1.5 * capacity

    def rate(t: float) -> float:
        # trough at 04:00, peak at 16:00
        phase = 2 * math.pi * (t / duration - 4 / 24)
        value = base_low + (base_high - base_low) * 0.5 * (1 - math.cos(phase))
        return value + sum(spike for a, b in spikes if a <= t < b)

    return Trace(
        "bursty-day",
        duration,
        rate,
        base_high + spike * len(spikes),
        f"diurnal {base_low:g}..{base_high:g} req/s, spikes +{spike:g} at "
        + ", ".join(f"{a:.0f}-{b:.0f} s" for a, b in sorted(spikes)),
    )
