"""`kubellm plan --calibrate URL`: a running replica's capacity at the SLO, measured.

The trace plan simulates replicas of one profile (`llama-3.1-8b-h100`). Where
a real replica is at hand, this measures what it serves instead, the way the
benchmark calibrates its simulated replica (`experiment.calibrate`: a constant
rate, the share of requests meeting the SLO), but over HTTP against the URL:

- one point: Poisson arrivals at `rate` for `seconds` (at most `max_requests`
  requests), each a streamed completion (`stream_one`: `/v1/completions` with
  SSE, timed per chunk as `kubellm bench` times them; the tools do not import
  each other, so this is its own small client) with a
  prompt of about the trace's prompt tokens (common words, one token each in
  most vocabularies; the server's usage chunk gives the real count) and
  `max_tokens` of its output tokens with `ignore_eos`, so every request decodes
  its length; a request meets the SLO when it streamed, its TTFT <= the SLO's and
  its mean inter-token time <= the SLO's ITL; errors and timeouts miss it;
- the search: double the rate from `start_rps` while the objective holds
  (at most `max_points` points in all), then bisect between the last rate that
  held and the first that did not, `bisections` times; the capacity is the
  highest rate that held;
- the fit: the simulated profile's step costs are multiplied by one factor
  (`Profile.slowed`) until the simulated replica serves the measured capacity
  for the same request sizes (the sizes the server reported): the plan then
  simulates *that* replica, so its figures are about the measured hardware.

Every wait is bounded: the model listing by `timeout` for the whole answer
(a server trickling bytes is cut off), each request by `request_timeout`, each
point by `seconds` plus the time its last requests may take (`drain_seconds`),
the whole search by `max_points`. Every read is bounded too: the listing at
`MAX_MODELS_BYTES`, each stream line at `MAX_LINE_BYTES` and each stream at
`MAX_STREAM_BYTES` (a server sending one endless line is an error, not memory).
Loopback or a replica you own: this sends load.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kubellm import api, bounded

# Short, frequent words: about one token each in the usual byte-pair vocabularies.
_WORD_TEXT = """
the of and to in is was for that on as with by at from his an were are which this be has
had one or have not but they their all new first its been also after who more two time
other into her can out up about there when over only would year some most
"""
WORDS = tuple(_WORD_TEXT.split())

DEFAULT_SECONDS = 30.0
DEFAULT_MAX_POINTS = 10
DEFAULT_BISECTIONS = 3
# The bounds on what a replica may send: an OpenAI-style /v1/models is a few KiB, one SSE
# event of a completion chunk well under 64 KiB (a chunk carries a few tokens' text), and a
# whole stream of `max_tokens` chunks far under the stream bound.
MAX_MODELS_BYTES = 1024 * 1024
MAX_LINE_BYTES = 1024 * 1024
MAX_STREAM_BYTES = 256 * 1024 * 1024


class CalibrationError(ValueError):
    """The replica could not be measured (unreachable, no model, nothing met the SLO)."""


@dataclass(frozen=True)
class Point:
    rate: float  # requests/s offered
    sent: int
    met: int
    errors: int
    ttft_p95: float | None
    itl_p95: float | None  # of each request's mean inter-token time
    prompt_tokens: float | None  # mean, as the server reported
    output_tokens: float | None  # mean
    wall_s: float

    @property
    def attainment(self) -> float:
        return self.met / self.sent if self.sent else 1.0


@dataclass
class Calibration:
    url: str
    model: str
    capacity_rps: float
    objective: float
    points: list[Point] = field(default_factory=list)
    sizes: list[tuple[int, int]] = field(default_factory=list)  # (prompt, output) measured
    bounded: bool = True  # some rate missed the objective (False: capacity is a lower bound)
    slowdown: float | None = None  # the fitted profile's step-cost factor
    simulated_rps: float | None = None  # what the fitted simulated replica serves

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "capacity_rps": self.capacity_rps,
            "bounded": self.bounded,
            "objective": self.objective,
            "slowdown": self.slowdown,
            "simulated_rps": self.simulated_rps,
            "points": [{**asdict(p), "attainment": round(p.attainment, 4)} for p in self.points],
        }


@dataclass(frozen=True)
class Target:
    url: str  # base URL, with or without /v1
    model: str
    timeout_s: float = 120.0

    @property
    def completions(self) -> str:
        base = self.url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + "/completions"


@dataclass(frozen=True)
class Streamed:
    """One streamed request's timings (error: why it failed; then no timing counts)."""

    ttft: float | None = None
    itl: float = 0.0  # mean seconds between tokens after the first
    prompt_tokens: int | None = None  # as the server's usage chunk reports
    output_tokens: int = 0
    error: str | None = None


async def bounded_lines(
    chunks: AsyncIterable[bytes],
    line_limit: int = MAX_LINE_BYTES,
    total_limit: int = MAX_STREAM_BYTES,
) -> AsyncIterator[str]:
    """The lines of a byte stream (the last one without its newline too), decoded as UTF-8;
    `bounded.AnswerTooLarge` once a line passes `line_limit` bytes or the stream
    `total_limit`, so memory holds at most a line's bound plus one chunk."""
    buffer, total = bytearray(), 0
    async for chunk in chunks:
        total += len(chunk)
        if total > total_limit:
            raise bounded.AnswerTooLarge(f"stream longer than {total_limit} bytes")
        buffer += chunk
        *lines, rest = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
        buffer = bytearray(rest)
        if len(buffer) > line_limit:
            raise bounded.AnswerTooLarge(f"a line longer than {line_limit} bytes")
    if buffer:
        yield buffer.rstrip(b"\r").decode("utf-8", "replace")


async def stream_one(
    client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int
) -> Streamed:
    """POST one streamed completion (`ignore_eos`: it decodes `max_tokens`) and time it."""
    body = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    first = last = None
    chunks, usage_prompt, usage_output = 0, None, None
    try:
        async with client.stream("POST", target.completions, json=body) as response:
            if response.status_code != 200:
                head = bytearray()  # the error's first 200 bytes, never the whole body
                async for chunk in response.aiter_bytes():
                    head += chunk
                    if len(head) >= 200:
                        break
                text = head[:200].decode(errors="replace")
                return Streamed(error=f"HTTP {response.status_code}: {text}")
            async for line in bounded_lines(response.aiter_bytes()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if isinstance(event.get("error"), dict):
                    return Streamed(error=f"stream error: {event['error'].get('message')}")
                usage = event.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_output = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        usage_prompt = int(usage["prompt_tokens"])
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    chunks += 1
    except (httpx.HTTPError, ValueError) as error:  # bounded.AnswerTooLarge is a ValueError
        return Streamed(error=f"{type(error).__name__}: {error} ({target.completions})")
    if first is None or last is None:
        return Streamed(error="no token was streamed")
    outputs = usage_output if usage_output is not None else chunks
    return Streamed(
        ttft=first - start,
        itl=(last - first) / (outputs - 1) if outputs > 1 else 0.0,
        prompt_tokens=usage_prompt,
        output_tokens=outputs,
    )


def _prompt(tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, tokens)))


def _p95(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4)


async def served_model(url: str, timeout: float = 10.0, limit: int = MAX_MODELS_BYTES) -> str:
    """The first model the server lists at /v1/models: the whole answer within `timeout`
    seconds and `limit` bytes."""
    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    try:
        async with (
            asyncio.timeout(timeout),
            httpx.AsyncClient(timeout=timeout) as client,
            client.stream("GET", base + "/models") as response,
        ):
            response.raise_for_status()
            length = response.headers.get("content-length", "")
            declared = int(length) if length.isdigit() else None
            body = await bounded.read_capped(response.aiter_bytes(), limit, declared)
        data = json.loads(body).get("data") or []
    except TimeoutError:
        raise CalibrationError(
            f"--calibrate {url}: cannot list its models: no whole answer in {timeout:g} s"
        ) from None
    except (httpx.HTTPError, ValueError, AttributeError) as error:
        raise CalibrationError(f"--calibrate {url}: cannot list its models: {error}") from None
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise CalibrationError(f"--calibrate {url}: /v1/models lists no model")
    return str(data[0]["id"])


async def measure(
    target: Target,
    rate: float,
    seconds: float,
    sizes: Sequence[tuple[int, int]],
    slo: api.SLO,
    max_requests: int,
    drain_seconds: float,
    seed: int = 0,
) -> Point:
    """One point: Poisson arrivals at `rate` for `seconds` (at most `max_requests`)."""
    rng = random.Random(f"calibrate/{seed}/{rate:.6g}")
    offsets, t = [], 0.0
    while len(offsets) < max_requests:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        offsets.append(t)
    if not offsets:
        offsets = [0.0]
    requests = []
    for _ in offsets:
        prompt, output = rng.choice(sizes)
        requests.append((_prompt(prompt, rng), max(1, output)))
    started = time.monotonic()

    async def one(client: httpx.AsyncClient, at: float, prompt: str, output: int) -> Streamed:
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        try:
            return await asyncio.wait_for(
                stream_one(client, target, prompt, output), target.timeout_s
            )
        except TimeoutError:
            return Streamed(error="timed out")

    timeout = httpx.Timeout(target.timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = [
            asyncio.ensure_future(one(client, at, prompt, output))
            for at, (prompt, output) in zip(offsets, requests, strict=True)
        ]
        done, pending = await asyncio.wait(tasks, timeout=seconds + drain_seconds)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
    results = [task.result() for task in done if not task.cancelled()]
    met = errors = 0
    ttfts, itls, prompts, outputs = [], [], [], []
    for result in results:
        if result.error is not None or result.ttft is None:
            errors += 1
            continue
        itl = result.itl
        ttfts.append(result.ttft)
        itls.append(itl)
        if result.prompt_tokens is not None:
            prompts.append(result.prompt_tokens)
        outputs.append(result.output_tokens)
        if result.ttft <= slo.ttft_seconds and itl <= slo.itl_seconds:
            met += 1
    return Point(
        rate=round(rate, 4),
        sent=len(offsets),
        met=met,
        errors=errors + len(offsets) - len(results),
        ttft_p95=_p95(ttfts),
        itl_p95=_p95(itls),
        prompt_tokens=round(sum(prompts) / len(prompts), 1) if prompts else None,
        output_tokens=round(sum(outputs) / len(outputs), 1) if outputs else None,
        wall_s=round(time.monotonic() - started, 2),
    )


async def search(
    url: str,
    sizes: Sequence[tuple[int, int]],
    slo: api.SLO,
    objective: float = 0.99,
    model: str | None = None,
    start_rps: float = 1.0,
    seconds: float = DEFAULT_SECONDS,
    max_points: int = DEFAULT_MAX_POINTS,
    bisections: int = DEFAULT_BISECTIONS,
    max_requests: int = 2000,
    request_timeout: float = 120.0,
    seed: int = 0,
    log: Any = None,
) -> Calibration:
    """The highest rate at which `objective` of requests meet `slo` on the replica at `url`."""
    if not sizes:
        raise CalibrationError("--calibrate: no request sizes to send")
    if not (start_rps > 0 and seconds > 0 and max_points >= 1 and max_requests >= 1):
        raise CalibrationError("--calibrate: the rate, seconds and counts must be positive")
    name = model or await served_model(url)
    target = Target(url=url, model=name, timeout_s=request_timeout)
    # a request may take its TTFT and ITL budget several times over before it counts as late
    longest = max(o for _, o in sizes)
    drain = min(request_timeout, 4 * (slo.ttft_seconds + slo.itl_seconds * longest) + 5.0)
    out = Calibration(url, name, 0.0, objective)
    passed, failed = 0.0, math.inf

    async def point(rate: float) -> bool:
        measured = await measure(target, rate, seconds, sizes, slo, max_requests, drain, seed)
        out.points.append(measured)
        if log is not None:
            log(
                f"calibrate: {rate:.3g} req/s: {measured.met}/{measured.sent} met the SLO "
                f"({measured.attainment:.1%}; TTFT p95 {measured.ttft_p95}, ITL p95 "
                f"{measured.itl_p95}, {measured.errors} errors) in {measured.wall_s:g} s"
            )
        if measured.errors == measured.sent:
            raise CalibrationError(
                f"--calibrate {url}: every request failed at {rate:g} req/s (is it serving "
                f"{name!r}?)"
            )
        return measured.attainment >= objective

    rate = start_rps
    while len(out.points) < max_points:
        if await point(rate):
            passed = rate
            rate *= 2
        else:
            failed = rate
            break
    steps = 0
    while math.isfinite(failed) and steps < bisections and len(out.points) < max_points:
        middle = (passed + failed) / 2 if passed > 0 else failed / 2
        if await point(middle):
            passed = middle
        else:
            failed = middle
        steps += 1
    if passed <= 0:
        raise CalibrationError(
            f"--calibrate {url}: no rate met {objective:.0%} of the SLO (the lowest tried: "
            f"{out.points[-1].rate:g} req/s); lower --calibrate-start or check the SLO"
        )
    out.capacity_rps = round(passed, 3)
    out.bounded = math.isfinite(failed)
    good = [p for p in out.points if p.prompt_tokens is not None and p.output_tokens is not None]
    if good:  # the sizes as the server counted them (words are about a token each)
        ratio = sum(p.prompt_tokens or 0 for p in good) / len(good)
        asked = sum(s[0] for s in sizes) / len(sizes)
        scale = ratio / asked if asked else 1.0
        out.sizes = [(max(1, round(p * scale)), o) for p, o in sizes]
    else:
        out.sizes = list(sizes)
    return out


def fit_slowdown(
    capacity_rps: float,
    meets: Any,
    low: float = 1 / 256,
    high: float = 4096.0,
    steps: int = 12,
) -> float:
    """The step-cost factor at which the simulated replica just serves `capacity_rps`.

    `meets(rate, slowdown)`: whether the simulated replica, its step costs times
    `slowdown`, meets the objective at `rate` (`plan.meets`). A replica's capacity falls as
    its steps slow, so the largest factor that still meets it at `capacity_rps` is the
    calibrated replica: bisected in log space, `steps` simulated runs of one replica.
    """
    if not meets(capacity_rps, low):
        raise CalibrationError(
            f"the simulated replica cannot serve {capacity_rps:g} req/s of these requests "
            "within the SLO even at 1/256 of its step costs"
        )
    if meets(capacity_rps, high):
        return high
    for _ in range(steps):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(capacity_rps, middle) else (low, middle)
    return round(low, 4)


def simulated_capacity(meets: Any, slowdown: float, near: float, steps: int = 6) -> float:
    """What the simulated replica at `slowdown` serves, bisected by the same `meets` the fit
    uses, from a bracket around `near` (the measured capacity): 0.25x .. 4x, `steps` runs."""
    low, high = near / 4, near * 4
    if not meets(low, slowdown):
        return round(low, 3)
    if meets(high, slowdown):
        return round(high, 3)
    for _ in range(steps):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(middle, slowdown) else (low, middle)
    return round(low, 3)
