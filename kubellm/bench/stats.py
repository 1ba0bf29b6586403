"""From per-request measurements to the figures of a run (pure).

Definitions follow `vllm bench serve`, so the two can be compared:
- TTFT: request sent -> first streamed chunk carrying text.
- ITL: gap between consecutive text chunks; percentiles pool every gap of every
  request (a chunk may carry several tokens, so this is per chunk).
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one token.
- E2E: request sent -> last text chunk.
- Throughput: completed requests, and output tokens, per second of the run's
  wall-clock duration (first send to last answer).
- Goodput (DistServe): a request is good when it succeeded, its TTFT is at most
  the TTFT target and its TPOT (mean inter-token time) at most the ITL target;
  reported as the share of all requests sent and as good requests per second.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50.0, 90.0, 95.0, 99.0)


@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None
    start: float = 0.0  # seconds since the run's start

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        "mean": sum(values) / len(values) if values else None,
    }
    for p in PERCENTILES:
        out[f"p{p:g}"] = percentile(values, p)
    return out


def is_good(result: RequestResult, ttft_target: float | None, itl_target: float | None) -> bool:
    """DistServe's test for one request: succeeded and met both targets."""
    if not result.ok:
        return False
    if ttft_target is not None and (result.ttft is None or result.ttft > ttft_target):
        return False
    tpot = result.tpot
    return itl_target is None or tpot is None or tpot <= itl_target


# Numbers that say where or when, kept as they are when errors are grouped: URLs,
# host:port and IP addresses (a refused connection must name them), Python's
# ('host', port) tuples, errno codes, and Retry-After delays.
_KEPT = re.compile(
    r"https?://\S+"
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"
    r"|\b[A-Za-z][\w.-]*:\d+\b"
    r"|\('[^']*', \d+\)"
    r"|\[Errno \d+\]"
    r"|(?i:retry[- ]after)\W*\d+(?:\.\d+)?"
)


def _mask_numbers(text: str) -> str:
    """Numbers -> N, except those in the spans _KEPT matches."""
    out, last = [], 0
    for kept in _KEPT.finditer(text):
        out += [re.sub(r"\d+", "N", text[last : kept.start()]), kept.group()]
        last = kept.end()
    out.append(re.sub(r"\d+", "N", text[last:]))
    return "".join(out)


def error_kind(error: str | None) -> str:
    """Group messages that differ only in counts and ids; keep the status, the addresses
    and the Retry-After delays (see _KEPT)."""
    line = (error or "error").splitlines()[0]
    status, _, rest = line.partition(": ") if line.startswith("HTTP ") else ("", "", line)
    return ((status + ": ") if status else "") + _mask_numbers(rest)[:160]


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    *,
    ttft_target: float | None = None,
    itl_target: float | None = None,
    label: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The figures of one run, as a flat-ish JSON-able dict."""
    done = [r for r in results if r.ok]
    duration = max(duration, 1e-9)
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in done)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kind = error_kind(r.error)
            errors[kind] = errors.get(kind, 0) + 1
    summary: dict[str, Any] = {
        **(label or {}),
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": prompt_tokens,
        "ttft_s": _dist([r.ttft for r in done if r.ttft is not None]),
        "itl_s": _dist([gap for r in done for gap in r.itls]),
        "tpot_s": _dist([t for r in done if (t := r.tpot) is not None]),
        "e2e_s": _dist([r.e2e for r in done if r.e2e is not None]),
    }
    if ttft_target is not None or itl_target is not None:
        good = sum(1 for r in results if is_good(r, ttft_target, itl_target))
        summary["goodput"] = {
            "ttft_target_s": ttft_target,
            "itl_target_s": itl_target,
            "good_requests": good,
            "share": good / len(results) if results else 0.0,
            "rate": good / duration,
        }
    return summary
