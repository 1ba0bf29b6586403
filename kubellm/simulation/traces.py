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

import csv
import datetime as dt
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


STEP_AT = 120.0  # the step trace's load steps up at this simulated second (x scale)


def step(capacity: float, scale: float = 1.0) -> Trace:
    """Half a replica's load, then 3.5 replicas' worth at once: the scale-up reflex."""
    before, duration = STEP_AT * scale, 480.0 * scale
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
    """Six hours of a working day in real time: a diurnal rise plus short spikes.

    `21,600 x scale` simulated seconds, one per real second, so the model load,
    the control period and the scale-down window keep their real length. The
    base load rises from 0.4 replicas' worth (early morning) to a peak of 3
    at the fourth hour and eases to 1.7 by the sixth (a cosine of an 8-hour
    period). Ten spikes add 1.5 replicas' worth for 30-150 s each (bursts
    shorter than a few model loads: a batch job, a retry storm, a launch),
    at seeded times.
    """
    duration = 21_600.0 * scale
    rng = random.Random(f"spikes-6h/{seed}")
    spikes = []
    for _ in range(10):
        start = rng.uniform(0.05, 0.95) * duration
        spikes.append((start, start + rng.uniform(30.0, 150.0) * scale))
    base_low, base_high, spike = 0.4 * capacity, 3.0 * capacity, 1.5 * capacity
    period = 8 * 3600.0 * scale

    def rate(t: float) -> float:
        value = base_low + (base_high - base_low) * 0.5 * (1 - math.cos(2 * math.pi * t / period))
        return value + sum(spike for a, b in spikes if a <= t < b)

    overlap = max(sum(1 for a, b in spikes if a <= start < b) for start, _ in spikes)
    return Trace(
        "bursty-day",
        duration,
        rate,
        base_high + spike * overlap,
        f"6 h in real time: base {base_low:g}..{base_high:g} req/s, {len(spikes)} spikes "
        f"+{spike:g} req/s of 30-150 s",
    )


def compressed_day(capacity: float, scale: float = 1.0, seed: int = 0) -> Trace:
    """Issue #6's day: a diurnal curve (night trough 0.4, afternoon peak 3 replicas' worth)
    plus spikes, 24 hours compressed into `1440 x scale` simulated seconds while the model
    load and the scale-down window stay in real seconds (mixed time scales: kept for the
    old figures only). Four spikes add 1.5 replicas' worth for 60-120 s each.
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
        "compressed-day",
        duration,
        rate,
        base_high + spike * len(spikes),
        f"diurnal {base_low:g}..{base_high:g} req/s, spikes +{spike:g} at "
        + ", ".join(f"{a:.0f}-{b:.0f} s" for a, b in sorted(spikes)),
    )


def bursty_hour(capacity: float, scale: float = 1.0, seed: int = 0) -> Trace:
    """One hour shaped like a bursty production trace superposed x8 (as the issue ran
    Azure's code trace): eight copies of a stream at 0.25 replicas' worth (2 replicas' worth
    in all, drifting +-25% over 15 minutes), where each copy bursts to 3-10x its own mean for
    30-120 s, one burst every 12 minutes per copy (every 90 s in all; bursts may overlap).
    Generated, seeded: no data set is read.
    """
    duration = 3600.0 * scale
    rng = random.Random(f"bursty-hour/{seed}")
    copies, per_copy = 8, 0.25 * capacity
    bursts: list[tuple[float, float, float]] = []
    for _ in range(copies):
        t = rng.expovariate(1 / 720.0)
        while t < duration:
            length = rng.uniform(30.0, 120.0) * scale
            bursts.append((t, t + length, per_copy * (rng.uniform(3.0, 10.0) - 1.0)))
            t += length + rng.expovariate(1 / 720.0)
    phase = rng.uniform(0, 2 * math.pi)
    base = copies * per_copy

    def rate(t: float) -> float:
        level = base * (1 + 0.25 * math.sin(2 * math.pi * t / (900.0 * scale) + phase))
        return level + sum(x for a, b, x in bursts if a <= t < b)

    peak = max(rate(float(t)) for t in range(int(duration) + 1))
    return Trace(
        "bursty-hour",
        duration,
        rate,
        peak,
        f"1 h generated, x8-superposed shape: base {base:g} req/s +-25%, {len(bursts)} bursts "
        f"(one copy at 3-10x its mean) of 30-120 s",
    )


def smooth_hour(capacity: float, scale: float = 1.0, seed: int = 0) -> Trace:
    """One hour shaped like a smooth production trace (Azure's conversation trace,
    superposed x8): about 5 replicas' worth, drifting +-15% over a 20-minute wave with
    +-5% wiggles over 2 minutes, no bursts. Generated, seeded: no data set is read.
    """
    duration = 3600.0 * scale
    rng = random.Random(f"smooth-hour/{seed}")
    mean = 5.0 * capacity
    a, b = rng.uniform(0, 2 * math.pi), rng.uniform(0, 2 * math.pi)

    def rate(t: float) -> float:
        slow = 0.15 * math.sin(2 * math.pi * t / (1200.0 * scale) + a)
        fast = 0.05 * math.sin(2 * math.pi * t / (120.0 * scale) + b)
        return mean * (1 + slow + fast)

    return Trace(
        "smooth-hour",
        duration,
        rate,
        mean * 1.2,
        f"1 h generated: {mean:g} req/s +-15% over 20 min, +-5% over 2 min",
    )


# --------------------------------------------------------------------------- recorded traces

# Column names accepted in a trace CSV (case-insensitive), as public traces name them.
TIME_COLUMNS = ("timestamp", "time", "arrival_time")
PROMPT_COLUMNS = ("prompt_tokens", "input_tokens", "contexttokens", "context_tokens")
OUTPUT_COLUMNS = ("output_tokens", "generatedtokens", "generated_tokens", "completion_tokens")
MAX_PROMPT_TOKENS = 8000  # the simulated replicas' context (longer prompts are clipped)
MAX_OUTPUT_TOKENS = 2048
RATE_BIN_SECONDS = 60.0  # a recorded trace's rate curve: arrivals per minute
# The longest span a recorded trace may cover: public traces run from an hour to a week,
# and the simulation steps through every second of it (a stray stamp, or one in
# milliseconds, would make it simulate centuries).
MAX_SPAN_SECONDS = 31 * 24 * 3600.0
MAX_RATE_SCALE = 1000.0
MAX_REQUESTS = 10_000_000  # after --rate-scale: about 1 GiB of arrivals


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file, line and column."""


@dataclass(frozen=True)
class RecordedTrace(Trace):
    """A trace read from a CSV file: its own arrivals; the rate curve is their count per
    minute (for the fixed fleet's size and the reference sizings)."""

    recorded: tuple[Arrival, ...] = field(default=(), repr=False)
    clipped: int = 0  # requests whose sizes were clipped to the simulated replicas' limits

    def arrivals(self, seed: int, mix: Mix = MIXES["long"]) -> list[Arrival]:
        return list(self.recorded)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def _count(text: str) -> int:
    """A token count: a finite number (a fraction is cut)."""
    return int(_finite(text))


def _parse_time(text: str) -> float:
    """Seconds: a finite number, or an ISO 8601 date-time (fractions past microseconds
    dropped)."""
    text = text.strip()
    try:
        return _finite(text)
    except ValueError as error:
        if str(error) == "not a finite number":
            raise
    head, dot, fraction = text.partition(".")
    if dot:  # "2023-11-16 18:15:46.6805900": Python takes at most 6 fractional digits
        digits = "".join(c for c in fraction if c.isdigit())
        rest = fraction[len(digits) :]
        text = f"{head}.{digits[:6]}{rest}"
    stamp = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    return stamp.timestamp()


def _column(header: Sequence[str], names: Sequence[str], what: str, path: Path) -> int:
    lowered = [h.strip().lower() for h in header]
    for name in names:
        if name in lowered:
            return lowered.index(name)
    raise TraceError(
        f"{path}: no {what} column; expected one of {', '.join(names)} (any case), "
        f"found {', '.join(h.strip() for h in header) or 'none'}"
    )


def read_csv(path: Path, rate_scale: float = 1.0, seed: int = 0) -> RecordedTrace:
    """A CSV trace: a timestamp column and prompt and output token columns.

    Times are made relative to the earliest request. `rate_scale` X superposes
    X copies of the trace, each circularly shifted by a seeded random offset,
    so the trace keeps its length and its burstiness at X times the rate (a
    fractional part adds one copy thinned to that share).
    """
    try:
        handle = path.open(newline="", encoding="utf-8-sig")
    except OSError as error:
        raise TraceError(f"--trace: cannot read {path}: {error.strerror or error}") from None
    rows: list[tuple[float, int, int, int]] = []
    clipped = 0
    with handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path}: empty file; expected a header line")
        columns = (
            _column(header, TIME_COLUMNS, "timestamp", path),
            _column(header, PROMPT_COLUMNS, "prompt-token", path),
            _column(header, OUTPUT_COLUMNS, "output-token", path),
        )
        for row in _rows(reader, path):
            line = reader.line_num
            if not any(cell.strip() for cell in row):
                continue
            values = []
            for index, name in zip(
                columns, ("timestamp", "prompt tokens", "output tokens"), strict=True
            ):
                cell = row[index] if index < len(row) else ""
                try:
                    values.append(_parse_time(cell) if not values else _count(cell))
                except ValueError as error:
                    raise TraceError(
                        f"{path}:{line}: {header[index].strip()} ({name}): cannot read "
                        f"{cell[:40]!r}{_why(error)}"
                    ) from None
            when, prompt, output = values
            if prompt < 0 or output < 0:
                raise TraceError(f"{path}:{line}: token counts must not be negative")
            sized = (min(max(prompt, 1), MAX_PROMPT_TOKENS), min(max(output, 1), MAX_OUTPUT_TOKENS))
            clipped += sized != (prompt, output)
            rows.append((when, *sized, line))
    return _recorded(path, rows, clipped, rate_scale, seed)


def read_jsonl(path: Path, rate_scale: float = 1.0, seed: int = 0) -> RecordedTrace:
    """A JSONL trace: one request per line, a JSON object with the CSV's column names as
    keys (a timestamp, prompt and output tokens; any case); `rate_scale` as `read_csv`."""
    try:
        handle = path.open(encoding="utf-8-sig")
    except OSError as error:
        raise TraceError(f"--trace: cannot read {path}: {error.strerror or error}") from None
    rows: list[tuple[float, int, int, int]] = []
    clipped = 0
    wanted = (
        (TIME_COLUMNS, "timestamp"),
        (PROMPT_COLUMNS, "prompt-token"),
        (OUTPUT_COLUMNS, "output-token"),
    )
    with handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise TraceError(f"{path}:{line}: not JSON: {error.msg}") from None
            if not isinstance(record, dict):
                raise TraceError(f"{path}:{line}: expected a JSON object per line")
            keys = {str(k).strip().lower(): v for k, v in record.items()}
            values: list[float] = []
            for names, what in wanted:
                key = next((n for n in names if n in keys), None)
                if key is None:
                    raise TraceError(
                        f"{path}:{line}: no {what} field; expected one of {', '.join(names)} "
                        "(any case)"
                    )
                cell = keys[key]
                try:
                    if isinstance(cell, bool) or not isinstance(cell, int | float | str):
                        raise ValueError
                    values.append(_parse_time(str(cell)) if not values else _count(str(cell)))
                except ValueError as error:
                    raise TraceError(
                        f"{path}:{line}: {key} ({what}): cannot read {str(cell)[:40]!r}"
                        f"{_why(error)}"
                    ) from None
            when, prompt, output = values
            if prompt < 0 or output < 0:
                raise TraceError(f"{path}:{line}: token counts must not be negative")
            sized = (min(max(int(prompt), 1), MAX_PROMPT_TOKENS),
                     min(max(int(output), 1), MAX_OUTPUT_TOKENS))  # fmt: skip
            clipped += sized != (prompt, output)
            rows.append((when, *sized, line))
    return _recorded(path, rows, clipped, rate_scale, seed)


def _rows(reader: Any, path: Path) -> Iterator[list[str]]:
    """The CSV reader's rows, its own errors (a field past its size limit) named by line."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as error:
            raise TraceError(f"{path}:{reader.line_num}: {error}") from None
        yield row


def _why(error: ValueError) -> str:
    return " (not a finite number)" if str(error) == "not a finite number" else ""


def write_csv(path: Path, arrivals: Sequence[Arrival]) -> None:
    """Arrivals as a CSV trace `read_csv` reads back (timestamp in seconds, to 0.1 ms)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        handle.write("timestamp,prompt_tokens,output_tokens\n")
        for a in arrivals:
            handle.write(f"{a.time:.4f},{a.prompt_tokens},{a.output_tokens}\n")


def read_file(path: Path, rate_scale: float = 1.0, seed: int = 0) -> RecordedTrace:
    """A trace file: JSONL when its name ends in .jsonl (or .ndjson), else CSV."""
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        return read_jsonl(path, rate_scale, seed)
    return read_csv(path, rate_scale, seed)


def _recorded(
    path: Path, rows: list[tuple[float, int, int, int]], clipped: int, rate_scale: float, seed: int
) -> RecordedTrace:
    """The trace of `rows` (time, prompt, output, line), its span bounded by
    `MAX_SPAN_SECONDS` and its requests after `rate_scale` by `MAX_REQUESTS`."""
    if len(rows) < 2:
        raise TraceError(f"{path}: needs at least two requests, found {len(rows)}")
    if not 0 < rate_scale <= MAX_RATE_SCALE:  # also refuses nan
        raise TraceError(f"--rate-scale must be above 0 and at most {MAX_RATE_SCALE:g}")
    if len(rows) * rate_scale > MAX_REQUESTS:
        raise TraceError(
            f"{path}: {len(rows):,} requests x{rate_scale:g} are more than the "
            f"{MAX_REQUESTS:,} a plan simulates; cut the trace or lower --rate-scale"
        )
    rows.sort()
    first, last = rows[0], rows[-1]
    if last[0] - first[0] > MAX_SPAN_SECONDS:
        raise TraceError(
            f"{path}:{last[3]}: its timestamp is {last[0] - first[0]:.4g} s after the earliest "
            f"request's (line {first[3]}); a trace may span at most {MAX_SPAN_SECONDS:.0f} s "
            "(31 days): is that row stray, or are the stamps in milliseconds?"
        )
    start = first[0]
    base = [Arrival(t - start, p, o) for t, p, o, _ in rows]
    duration = max(base[-1].time, 1.0) + 1.0
    arrivals = _superpose(base, duration, rate_scale, random.Random(f"rate-scale/{seed}"))
    bins = [0] * math.ceil(duration / RATE_BIN_SECONDS)
    for a in arrivals:
        bins[min(len(bins) - 1, int(a.time // RATE_BIN_SECONDS))] += 1
    rates = tuple(b / RATE_BIN_SECONDS for b in bins)

    def rate(t: float) -> float:
        return rates[min(len(rates) - 1, max(0, int(t // RATE_BIN_SECONDS)))]

    scale = f" x{rate_scale:g}" if rate_scale != 1 else ""
    return RecordedTrace(
        path.stem,
        duration,
        rate,
        max(rates),
        f"{path.name}{scale}: {len(arrivals)} requests over {duration:.0f} s",
        recorded=tuple(arrivals),
        clipped=clipped,
    )


def _superpose(
    base: Sequence[Arrival], duration: float, scale: float, rng: random.Random
) -> list[Arrival]:
    copies = math.floor(scale)
    share = scale - copies
    out: list[Arrival] = list(base) if copies >= 1 else []
    for copy in range(1, copies + (1 if share > 1e-9 else 0)):
        offset = rng.uniform(0.0, duration)
        keep = share if copy == copies else 1.0
        for a in base:
            if keep < 1.0 and rng.random() >= keep:
                continue
            out.append(Arrival((a.time + offset) % duration, a.prompt_tokens, a.output_tokens))
    if copies == 0:  # scale < 1: the trace itself, thinned
        out = [a for a in base if rng.random() < share]
    out.sort(key=lambda a: a.time)
    return out
