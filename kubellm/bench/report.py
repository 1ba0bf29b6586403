"""Present bench results: a text table, a JSON document, PNG charts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def load_label(run: dict[str, Any]) -> str:
    """How a run was loaded: its rate, its concurrency, or the trace's own timing."""
    if run.get("rate") is not None:
        rate = run["rate"]
        return "inf" if rate == float("inf") else f"{rate:g}/s"
    if run.get("concurrency") is not None:
        return f"c={run['concurrency']}"
    return "trace"


HEADER = (
    "LOAD",
    "DONE",
    "FAIL",
    "REQ/S",
    "OUT TOK/S",
    "TTFT p50/p99 ms",
    "ITL p50/p99 ms",
    "TPOT p50 ms",
    "E2E p50/p99 ms",
    "GOODPUT",
)


def table(runs: Sequence[dict[str, Any]]) -> str:
    """One row per run; goodput as share (rate/s) when targets were given."""
    rows = [HEADER]
    for r in runs:
        good = r.get("goodput")
        rows.append(
            (
                load_label(r),
                str(r["completed"]),
                str(r["failed"]),
                f"{r['request_throughput']:.2f}",
                f"{r['output_throughput']:.1f}",
                f"{_ms(r['ttft_s']['p50'])}/{_ms(r['ttft_s']['p99'])}",
                f"{_ms(r['itl_s']['p50'])}/{_ms(r['itl_s']['p99'])}",
                _ms(r["tpot_s"]["p50"]),
                f"{_ms(r['e2e_s']['p50'])}/{_ms(r['e2e_s']['p99'])}",
                "-" if not good else f"{good['share']:.0%} ({good['rate']:.2f}/s)",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    for r in runs:
        for message, count in r.get("errors", {}).items():
            lines.append(f"  {load_label(r)}: {count} x {message}")
    return "\n".join(lines)


def plot(runs: Sequence[dict[str, Any]], path: Path) -> None:
    """Latency percentiles and goodput/throughput against the offered load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_rate = all(r.get("rate") is not None and r["rate"] != float("inf") for r in runs)
    if by_rate:
        xs, xlabel = [r["rate"] for r in runs], "request rate (req/s)"
    elif all(r.get("concurrency") is not None for r in runs):
        xs, xlabel = [r["concurrency"] for r in runs], "concurrency"
    else:
        xs, xlabel = list(range(1, len(runs) + 1)), "run"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        for p, style in (("p50", "-o"), ("p99", "--x")):
            ys = [r[key][p] * 1000 if r[key][p] is not None else float("nan") for r in runs]
            left.plot(xs, ys, style, label=f"{name} {p}")
    left.set_yscale("log")
    left.set_xlabel(xlabel)
    left.set_ylabel("latency (ms)")
    left.set_title("Latency percentiles")
    left.legend(fontsize=8)
    right.plot(xs, [r["request_throughput"] for r in runs], "-o", label="completed req/s")
    if all(r.get("goodput") for r in runs):
        g = runs[0]["goodput"]
        right.plot(
            xs,
            [r["goodput"]["rate"] for r in runs],
            "-s",
            label=f"goodput req/s (TTFT<={g['ttft_target_s']}s, ITL<={g['itl_target_s']}s)",
        )
    right.set_xlabel(xlabel)
    right.set_ylabel("requests per second")
    right.set_title("Throughput and goodput")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
