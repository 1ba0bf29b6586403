"""The shadow's cost to the stable side's TTFT p99 (issue 44: within 5% of without at a 10%
mirror share), on a machine too loaded for one pair of windows to show it.

Two simulated engines (`kubellm engine --backend sim`, real time, the H100 8B profile:
a 300-word prompt prefills in tens of ms), the stable one and a canary, behind three real
`kubellm gateway --static` processes: `off` and `off2` serve the stable engine alone (no
rollout), `shadow` has the canary in a shadow step (weight 0, spec.rollout.shadow's shipped
defaults unless flags say otherwise). The client sends streamed completions open loop
(Poisson arrivals at `--rate`) to one gateway at a time, in rounds: each round runs every
arm once, the arms in rotated order, all with the round's own arrival schedule (the prompts
are drawn alike but differ: no arm finds another's in an engine's prefix cache). So the
arms differ only by the mirror, and whatever load the machine has falls on all of them
alike, round by round.

Per round and arm: the client's TTFT p99 and p50, the gateway's CPU seconds per request
(its process's user + system time over the window and until its mirrors finish: the
physical cost of the mirror), the canary's requests and CPU, and the load average. The
summary: each arm's median over rounds, and per round the ratio of each arm's p99 to `off`'s
in the same round: `off2`/`off` is the noise (A/A), `shadow`/`off` the shadow's effect
(A/B), each with its median, range and a bootstrap 95% interval of the median over rounds.

    flock /tmp/bench.lock .venv/bin/python -m bench.canary_quality --stable-p99 [--rounds 12]

(`python -m bench.gateway.canary_p99` runs it too.)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

ARMS = ("off", "off2", "shadow")
BASE = "off"
MODEL = "sim"
CANARY = "shadow-p99"


def schedule(arms: Sequence[str], rounds: int) -> list[list[str]]:
    """Round r runs the arms rotated by r: each arm takes each position equally often."""
    n = len(arms)
    return [[arms[(r + k) % n] for k in range(n)] for r in range(rounds)]


def arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    """Poisson arrival offsets (seconds from the window's start) for one round."""
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < seconds:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def prompt(seed: int, index: int, words: int) -> str:
    """The `index`th prompt of a window: `words` words no other window sends (the engines
    cache prefixes: an arm sending the prompts another arm sent would skip their prefill)."""
    rng = random.Random(seed * 1_000_003 + index)
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(words))


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def bootstrap_median(
    values: Sequence[float], seed: int = 0, draws: int = 2000
) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median of `values`."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def summarize(rows: list[dict[str, Any]], base: str = BASE) -> dict[str, Any]:
    """`rows`: one per round, {arm: {"p99", "p50", "cpu_ms", ...}, "load": x}. Per arm the
    medians over rounds; per other arm the round-by-round p99 ratio to `base`."""
    arms = [a for a in rows[0] if isinstance(rows[0][a], dict)]
    out: dict[str, Any] = {
        "rounds": len(rows),
        "load": [min(r["load"] for r in rows), max(r["load"] for r in rows)],
    }
    for arm in arms:
        figures = {
            key: statistics.median(r[arm][key] for r in rows)
            for key in rows[0][arm]
            if isinstance(rows[0][arm][key], (int, float))
        }
        if arm != base:
            ratios = [r[arm]["p99"] / r[base]["p99"] for r in rows]
            low, high = bootstrap_median(ratios)
            figures["p99_ratio"] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
                "ci95": [low, high],
                "each": ratios,
            }
        out[arm] = figures
    return out


def report(summary: dict[str, Any], flags: str) -> list[str]:
    """The summary as a table, one row per arm."""
    lines = [
        f"stable TTFT p99 per arm ({flags}; {summary['rounds']} rounds, load average "
        f"{summary['load'][0]:.1f}-{summary['load'][1]:.1f})",
        "| arm | p99 (median over rounds) | p50 | p99 / off: median (range; 95% CI) "
        "| gateway CPU per request | canary requests per request | canary CPU per request |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm in (a for a in ARMS if a in summary):
        f = summary[arm]
        ratio = f.get("p99_ratio")
        text = (
            (
                f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f}; "
                f"{ratio['ci95'][0]:.3f}-{ratio['ci95'][1]:.3f})"
            )
            if ratio
            else "1"
        )
        lines.append(
            f"| {arm} | {f['p99'] * 1000:.1f} ms | {f['p50'] * 1000:.1f} ms | {text} | "
            f"{f['cpu_ms']:.2f} ms | {f['canary_requests']:.3f} | "
            f"{f['canary_cpu_ms']:.2f} ms |"
        )
    return lines


# --------------------------------------------------------------------------- the run


def _static(stable: str, canary: str | None, shadow: dict[str, Any]) -> dict[str, Any]:
    model: dict[str, Any] = {"name": MODEL, "endpoints": [stable]}
    if canary is not None:
        model["endpoints"] = [stable, {"url": canary, "revision": CANARY}]
        model["rollout"] = {
            "canaryRevision": CANARY,
            "phase": "Progressing",
            "canaryWeight": 0,
            "shadow": shadow,
        }
    return {"models": [model]}


def _engine_sum(url: str, *names: str) -> float:
    """The sum of an engine's samples named `names` on its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    families = text_string_to_metric_families(text)
    return sum(s.value for f in families for s in f.samples if s.name in names)


def _busy(url: str) -> float:
    """Requests running or waiting on a simulated engine."""
    from kubellm import metrics

    return _engine_sum(url, metrics.NUM_REQUESTS_RUNNING, metrics.NUM_REQUESTS_WAITING)


def _finished(url: str) -> float:
    return _engine_sum(url, "vllm:request_success_total")


def _cpu(process: Any) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def _window(
    url: str, offsets: list[float], seed: int, words: int, max_tokens: int
) -> tuple[list[float], list[str]]:
    """Open-loop arrivals at `offsets`: (TTFTs of the answered, why each failure failed)."""
    import httpx

    from bench import _client

    ttfts: list[float] = []
    failed: list[str] = []

    async def one(http: httpx.AsyncClient, index: int) -> None:
        body = {
            "model": MODEL,
            "prompt": prompt(seed, index, words),
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        out = await _client.stream(http, url, body, path="/v1/completions")
        if out["ok"]:
            ttfts.append(out["ttft"])
        else:
            response = out.get("response")
            failed.append(f"{out['status']} {response.text[:200] if response else ''}".strip())

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        start = time.monotonic()
        tasks = []
        for index, offset in enumerate(offsets):
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            tasks.append(asyncio.create_task(one(http, index)))
        await asyncio.gather(*tasks)
    return ttfts, failed


def _idle(urls: list[str], timeout: float = 60.0) -> None:
    """Until no engine runs or queues a request (the window's mirrors are done)."""
    deadline = time.monotonic() + timeout
    while any(_busy(u) for u in urls):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engines stayed busy {timeout:g} s after the window")
        time.sleep(0.05)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import psutil

    from bench._fleet import Processes
    from kubellm import api

    shadow = api.RolloutShadow.model_validate(
        {
            k: v
            for k, v in {"share": args.mirror_share, "maxConcurrency": args.max_concurrency}.items()
            if v is not None
        }
    ).model_dump(by_alias=True, mode="json")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, Processes() as fleet:
        sim = ("--profile", args.profile, "--served-model-name", MODEL)
        stable, canary = fleet.sim(*sim), fleet.sim(*sim)
        gateways: dict[str, str] = {}
        for arm in ARMS:
            path = Path(tmp) / f"{arm}.yaml"
            path.write_text(
                yaml.safe_dump(_static(stable, canary if arm == "shadow" else None, shadow))
            )
            gateways[arm] = fleet.gateway(path)
        pids = {arm: fleet.processes[2 + k].pid for k, arm in enumerate(ARMS)}
        procs = {arm: psutil.Process(pid) for arm, pid in pids.items()}
        canary_proc = psutil.Process(fleet.processes[1].pid)
        for arm in ARMS:  # warm each gateway's connections and code paths, not counted
            asyncio.run(
                _window(
                    gateways[arm], arrivals(args.p99_rate, 3, 999), 999, args.words, args.max_tokens
                )
            )
        _idle([stable, canary])
        print(
            f"shadow {shadow}; {args.p99_rate:g} req/s open loop, {args.p99_window:g} s windows, "
            f"~{args.words}-word prompts, {args.max_tokens} tokens, profile {args.profile}",
            flush=True,
        )
        for r, order in enumerate(schedule(ARMS, args.rounds)):
            offsets = arrivals(args.p99_rate, args.p99_window, args.p99_seed + r)
            row: dict[str, Any] = {}
            for arm in order:
                cpu0, can0, fin0 = _cpu(procs[arm]), _cpu(canary_proc), _finished(canary)
                window_seed = (args.p99_seed * 1000 + r) * len(ARMS) + ARMS.index(arm)
                ttfts, failed = asyncio.run(
                    _window(gateways[arm], offsets, window_seed, args.words, args.max_tokens)
                )
                _idle([stable, canary])
                sent = len(offsets)
                row[arm] = {
                    "p99": p99(ttfts),
                    "p50": statistics.median(ttfts),
                    "cpu_ms": 1000 * (_cpu(procs[arm]) - cpu0) / sent,
                    "canary_requests": (_finished(canary) - fin0) / sent,
                    "canary_cpu_ms": 1000 * (_cpu(canary_proc) - can0) / sent,
                    "sent": sent,
                    "failed": len(failed),
                    "why_failed": dict(collections.Counter(failed)),
                }
            row["load"] = os.getloadavg()[0]
            rows.append(row)
            print(
                f"round {r + 1} ({' '.join(order)}): "
                + ", ".join(
                    f"{a} p99 {row[a]['p99'] * 1000:.1f} ms (p50 {row[a]['p50'] * 1000:.0f}) "
                    f"cpu {row[a]['cpu_ms']:.2f} ms/req failed {row[a]['failed']}"
                    for a in ARMS
                )
                + f"; load {row['load']:.1f}",
                flush=True,
            )
    return {"shadow": shadow, "rows": rows, "summary": summarize(rows)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--stable-p99 (the simulator, three gateways)")
    group.add_argument("--rounds", type=int, default=12, help="rounds of every arm (12)")
    group.add_argument(
        "--p99-window",
        type=float,
        default=15.0,
        dest="p99_window",
        help="seconds per arm per round (15)",
    )
    group.add_argument(
        "--p99-rate", type=float, default=20.0, dest="p99_rate", help="requests/s, open loop (20)"
    )
    group.add_argument(
        "--mirror-share",
        type=float,
        default=None,
        dest="mirror_share",
        help="spec.rollout.shadow.share (default: the shipped 0.1)",
    )
    group.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="spec.rollout.shadow.maxConcurrency (default: the shipped 4)",
    )
    group.add_argument("--words", type=int, default=300, help="words per prompt (300)")
    group.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (16)")
    group.add_argument("--profile", default="llama-3.1-8b-h100", help="the engines' profile")
    group.add_argument("--p99-seed", type=int, default=1, dest="p99_seed")


def main_p99(args: argparse.Namespace) -> int:
    flags = (
        " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in (
                ("mirror-share", args.mirror_share),
                ("max-concurrency", args.max_concurrency),
            )
            if v is not None
        )
        or "shipped defaults"
    )
    out = run(args)
    for line in report(out["summary"], flags):
        print(line)
    if getattr(args, "json", None):
        args.json.write_text(json.dumps(out, indent=2))
    return 0 if all(r[a]["failed"] == 0 for r in out["rows"] for a in ARMS) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--json", type=Path, help="also write every figure here")
    return main_p99(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
