"""The quality canary end to end on real vLLM (CPU, the tiny checkpoint): how reliably the
rollout's verdict promotes an identical revision and rolls back a worse one before it takes
any client's request, and what the shadow costs the stable side's TTFT.

One process runs the real gateway (`Gateway` + `create_app` on loopback, as `kubellm up`
serves it) with a fixed discovery, and the real rollout state machine (`rollout.decide`, fed
by `figures.parse` of the gateway's own /metrics every 0.5 s, as `kubellm up --watch` and the
operator feed it). The rollout is a shadow step (weight 0: mirrored requests only, judged by
the quality gate) and a 50% step (real traffic, the latency analysis), then promotion.

Engines start once each: the stable checkpoint (float32) for the whole bench, and one canary
at a time beside it: `same` (the noise floor), `bf16`, `4bit` (every weight rounded to 15
levels) and `fewer-steps` (a quarter of the training). Each canary serves `--runs` rollouts,
each under a new revision name (fresh counters), a new seed and prompt order, with a steady
closed-loop load of streamed completions through the gateway. Per revision it prints the
verdicts of the runs, the mirrored requests the shadow step's verdict needed, and the real
requests the canary answered before it (0: the shadow step comes before any traffic share).

Then (`same` canary still up) the stable side's client TTFT p99 at a fixed open-loop rate,
with the shadow at `--ttft-share` and without, in alternating windows (ABAB...), each pair's
ratio, and the extra engine work the shadow caused (generated tokens, both engines, per real
request). Run under the vLLM lock (two engines, ~5 GiB each, minutes to start):

    flock /tmp/vllm.lock .venv/bin/python -m bench.canary_quality --runs 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import _client
from bench.gateway import canary_p99

MODEL = "tiny"
STABLE = "stable"


def rollout_spec(share: float, min_requests: int, pause: int) -> Any:
    """The bench's LLMDeployment spec: shipped analysis and quality defaults, but for the
    minimum request counts a tiny CPU engine reaches in minutes."""
    from kubellm import api

    return api.LLMDeploymentSpec.model_validate({
        "model": {"source": "file:///tiny", "servedName": MODEL},
        "replicas": 1,
        "rollout": {
            "strategy": "Canary",
            "steps": [{"weight": 0, "pauseSeconds": pause}, {"weight": 50, "pauseSeconds": pause}],
            "shadow": {"share": share},
            "analysis": {"minRequests": min_requests, "quality": {}},
        },
    })  # fmt: skip


class Bench:
    """The gateway, its discovery and the engines' URLs."""

    def __init__(self, stable_url: str) -> None:
        from kubellm.gateway.discovery.base import FixedDiscovery
        from kubellm.gateway.http.app import Gateway, GatewaySettings

        self.stable_url = stable_url
        self.discovery = FixedDiscovery()
        self.gateway = Gateway(self.discovery, GatewaySettings())
        self.url = ""
        self.publish(None, None, None)

    def publish(self, canary_url: str | None, revision: str | None, status: Any) -> None:
        """The target `kubellm up` would publish: the canary's endpoint while it has replicas,
        and the split of status.rollout."""
        from kubellm.gateway.discovery.base import Endpoint, ModelTarget, canary_split

        endpoints = [Endpoint(self.stable_url)]
        if canary_url is not None:
            endpoints.append(Endpoint(canary_url, revision=revision))
        target = ModelTarget(MODEL, MODEL, endpoints=tuple(endpoints))
        if status is not None:
            target = replace(target, canary=canary_split(status))
        self.discovery.update({MODEL: target})

    def counters(self) -> dict[str, Any]:
        from kubellm.operator import figures
        from prometheus_client import generate_latest

        return figures.parse(generate_latest(self.gateway.metrics.registry).decode(), MODEL)

    @contextlib.asynccontextmanager
    async def serving(self) -> Any:
        import uvicorn
        from kubellm.gateway.http import server as gateway_server
        from kubellm.gateway.http.app import create_app

        limits = gateway_server.ClientLimits()
        config = gateway_server.config(create_app(self.gateway), limits, lambda: None,
                                       host="127.0.0.1", port=0, log_level="warning")  # fmt: skip
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        deadline = time.monotonic() + 60
        while not server.started and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # uvicorn exposes no started event; poll its flag
        if not server.started:
            raise RuntimeError("the gateway did not start")
        self.url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            server.should_exit = True
            await asyncio.gather(task, return_exceptions=True)


DECODING: dict[str, Any] = {}  # the clients' decoding (--greedy: temperature 0)


async def one_request(http: Any, url: str, prompt: str, ttfts: list[float] | None) -> bool:
    """A streamed completion through the gateway (`bench._client`); its TTFT appended to
    `ttfts`."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, **DECODING}
    try:
        out = await _client.stream(http, url, body, path="/v1/completions")
    except Exception:  # a failed request counts as failed, the load goes on
        return False
    if out["ok"] and ttfts is not None:
        ttfts.append(out["ttft"])
    return out["ok"]


async def closed_loop(url: str, texts: list[str], concurrency: int, stop: asyncio.Event,
                      limit: int) -> list[bool]:  # fmt: skip
    """`concurrency` clients through `texts` in turn until `stop` or `limit` requests."""
    import httpx

    results: list[bool] = []
    cursor = iter(range(limit))

    async def client(http: httpx.AsyncClient) -> None:
        for i in cursor:
            if stop.is_set():
                return
            results.append(await one_request(http, url, texts[i % len(texts)], None))

    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return results


async def rollout_run(bench: Bench, spec: Any, canary_url: str, revision: str, texts: list[str],
                      args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One whole rollout of `revision` (its engine at `canary_url`) under load: decide()
    every 0.5 s until it promotes, rolls back or `--run-timeout` passes."""
    from kubellm.operator import rollout

    status: dict[str, Any] = {}
    stop = asyncio.Event()
    load = asyncio.create_task(closed_loop(bench.url, texts, args.concurrency, stop, 100_000))
    out: dict[str, Any] = {"verdict": "Inconclusive", "shadow_mirrored": None}
    deadline = time.monotonic() + args.run_timeout
    try:
        while time.monotonic() < deadline:
            counters = bench.counters()
            seen = rollout.Observation(desired_revision=revision, stable_revision=STABLE,
                                       stable_ready=True, canary_ready=True, now=time.time(),
                                       counters=counters)  # fmt: skip
            decision = rollout.decide(spec, status, seen)
            status = decision.status
            bench.publish(canary_url if decision.canary_replicas else None, revision, status)
            mine = counters.get(revision, rollout.Counters())
            verdict = decision.verdict
            said = (status.get("step"), verdict and verdict.reason)
            if args.verbose and said != out.get("said"):
                out["said"] = said
                print(f"    step {said[0]}: {verdict and verdict.message}", flush=True)
            if (
                out["shadow_mirrored"] is None
                and verdict is not None
                and (
                    (verdict.result != "Inconclusive" and status.get("step", 1) != 1)
                    or decision.rolled_back
                )
            ):  # the shadow step's verdict: its figures, the canary's real requests then
                figures = rollout.quality_figures(mine.minus(None))
                passed = status.get("step", 1) != 1
                out.update(shadow_mirrored=figures.get("mirrored"), shadow_real=mine.requests,
                           shadow_verdict="Pass" if passed else "Fail",
                           agreement=figures.get("agreement"),
                           token_agreement=figures.get("tokenAgreement"),
                           divergence=figures.get("divergence"))  # fmt: skip
            if decision.rolled_back:
                out.update(verdict="RolledBack", reason=decision.rolled_back[0],
                           step=status.get("step"), real=mine.requests,
                           message=decision.rolled_back[1])  # fmt: skip
                break
            if decision.mode == "promoting":
                out.update(verdict="Promoted", real=mine.requests)
                break
            await asyncio.sleep(0.5)
        else:
            out.update(reason=(decision.verdict.reason if decision.verdict else "NoVerdict"),
                       step=status.get("step"), real=mine.requests)  # fmt: skip
    finally:
        stop.set()
        done = await load
        bench.publish(None, None, None)
        await asyncio.sleep(0)  # let the gateway see the target without the canary
    out["requests"], out["failed"] = len(done), done.count(False)
    # the mirrors of this run still in flight finish before the next one starts
    end = time.monotonic() + 60
    while (bench.gateway.mirror.in_flight or bench.gateway.mirror.waiting) and (
        time.monotonic() < end
    ):
        await asyncio.sleep(0.1)
    return out


def pin(workdir: Path, cores: set[int] | None) -> int:
    """Pin every thread of the engine started in `workdir` (its launcher and the launcher's
    children, found by the spec file in their command line) to `cores` (None: all cores).
    How many threads were pinned."""
    import psutil

    cores = cores if cores is not None else set(range(os.cpu_count() or 1))
    marker = str(workdir)
    count = 0
    for proc in psutil.process_iter(["cmdline"]):
        if not any(marker in part for part in proc.info["cmdline"] or []):
            continue
        for member in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error, OSError):
                for thread in member.threads():
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(thread.id, cores)
                        count += 1
    return count


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def generated_tokens(urls: list[str]) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:generation_tokens_total":
                    total += sample.value
    return total


async def open_loop(url: str, texts: list[str], rate: float, seconds: float,
                    rng: random.Random) -> tuple[list[float], int, int]:  # fmt: skip
    """Poisson arrivals at `rate` per second for `seconds`: (TTFTs, sent, failed)."""
    import httpx

    ttfts: list[float] = []
    tasks = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=256)) as http:
        end = time.monotonic() + seconds
        nxt = time.monotonic()
        i = 0
        while nxt < end and i < int(rate * seconds * 3):
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            tasks.append(asyncio.create_task(one_request(http, url, texts[i % len(texts)], ttfts)))
            i += 1
            nxt += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
    return ttfts, len(results), results.count(False)


async def ttft_pairs(bench: Bench, canary_url: str, texts: list[str], args: argparse.Namespace,
                     dirs: tuple[Path, Path]) -> dict[str, Any]:  # fmt: skip
    """Alternating windows with the shadow (a weight-0 step at --ttft-share) and without,
    for each client decoding (sampled: the engine's default; greedy: temperature 0) and
    each placement (shared: both engines on every core; pinned: the stable engine on core
    0, the canary's on the last core)."""
    from prometheus_client import generate_latest

    from kubellm import metrics

    mirror = {"share": args.ttft_share, "maxConcurrency": 4, "firstTokens": 16}
    shadow = {"canaryRevision": "shadow-ttft", "phase": "Progressing", "canaryWeight": 0,
              "shadow": mirror}  # fmt: skip
    rng = random.Random(11)
    urls = [bench.stable_url, canary_url]
    decoding_before = dict(DECODING)  # the rollouts' (--greedy), restored at the end
    last = (os.cpu_count() or 1) - 1
    out: dict[str, Any] = {}
    for placement in args.placements:
        pinned = placement == "pinned"
        threads = (pin(dirs[0], {0} if pinned else None), pin(dirs[1], {last} if pinned else None))
        print(f"  {placement}: {threads} engine threads placed", flush=True)
        for decoding in args.decodings:
            DECODING.clear()
            DECODING.update({"temperature": 0} if decoding == "greedy" else {})
            await open_loop(bench.url, texts, args.rate, 10, rng)  # warm-up, not counted
            rows = []
            for pair in range(args.pairs):
                row: dict[str, Any] = {}
                for mode in ("with", "without") if pair % 2 == 0 else ("without", "with"):
                    if mode == "with":
                        bench.publish(canary_url, "shadow-ttft", shadow)
                    else:
                        bench.publish(None, None, None)
                    before = generated_tokens(urls)
                    text0 = generate_latest(bench.gateway.metrics.registry).decode()
                    ttfts, sent, failed = await open_loop(bench.url, texts, args.rate,
                                                          args.window, rng)  # fmt: skip
                    while bench.gateway.mirror.in_flight or bench.gateway.mirror.waiting:
                        await asyncio.sleep(0.1)  # its mirrors' work belongs to this window
                    text1 = generate_latest(bench.gateway.metrics.registry).decode()
                    row[mode] = {
                        "p99": p99(ttfts), "p50": statistics.median(ttfts) if ttfts else None,
                        "sent": sent, "failed": failed,
                        "tokens_per_request": (generated_tokens(urls) - before) / max(sent, 1),
                        "mirrored": _count(text1, metrics.GATEWAY_MIRROR_REQUESTS)
                        - _count(text0, metrics.GATEWAY_MIRROR_REQUESTS),
                        "shed": _count(text1, metrics.GATEWAY_MIRROR_SHED)
                        - _count(text0, metrics.GATEWAY_MIRROR_SHED),
                    }  # fmt: skip
                row["ratio"] = row["with"]["p99"] / row["without"]["p99"]
                row["load"] = os.getloadavg()[0]
                rows.append(row)
                print(f"  {placement} {decoding} pair {pair + 1}: p99 with "
                      f"{row['with']['p99'] * 1000:.0f} ms, without "
                      f"{row['without']['p99'] * 1000:.0f} ms, ratio {row['ratio']:.3f}; p50 "
                      f"{row['with']['p50'] * 1000:.0f} / {row['without']['p50'] * 1000:.0f} ms;"
                      f" mirrored {row['with']['mirrored']:.0f} (shed {row['with']['shed']:.0f})"
                      f" of {row['with']['sent']}; engine tokens per request "
                      f"{row['with']['tokens_per_request']:.2f} / "
                      f"{row['without']['tokens_per_request']:.2f}; load {row['load']:.1f}",
                      flush=True)  # fmt: skip
            out[f"{placement} {decoding}"] = rows
    pin(dirs[0], None)
    pin(dirs[1], None)
    DECODING.clear()
    DECODING.update(decoding_before)
    bench.publish(None, None, None)
    return out


def _count(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name in (name, name + "_total"))  # fmt: skip


def variants(base: Path, work: Path, only: list[str] | None) -> dict[str, tuple[Path, str]]:
    from kubellm.engine import tiny

    from bench.gateway.shadow_quality import round_to_4_bits

    out: dict[str, tuple[Path, str]] = {}
    for name in ("same", "4bit", "fewer-steps", "bf16"):
        if only and name not in only:
            continue
        if name == "4bit":
            round_to_4_bits(base, work / "4bit")
            out[name] = (work / "4bit", "float32")
        elif name == "fewer-steps":
            tiny.build(work / "fewer", train_steps=tiny.TRAIN_STEPS // 4)
            out[name] = (work / "fewer", "float32")
        else:
            out[name] = (base, "bfloat16" if name == "bf16" else "float32")
    return out


async def bench_revision(bench: Bench, spec: Any, name: str, canary_url: str,
                         texts: list[str], args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    runs = []
    for run in range(args.runs):
        order = random.Random(1000 + run).sample(texts, len(texts))
        got = await rollout_run(bench, spec, canary_url, f"{name}-{run}", order, args)
        runs.append(got)
        print(f"  {name} run {run + 1}: {got['verdict']} ({got.get('reason', '')}) after "
              f"{got['shadow_mirrored']} mirrored; real before the shadow verdict "
              f"{got.get('shadow_real')}, before the last {got.get('real')}; agreement "
              f"{got.get('agreement')}; load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    return {"runs": runs}


def summary(name: str, runs: list[dict[str, Any]]) -> str:
    verdicts = [r["verdict"] for r in runs]
    mirrored = [r["shadow_mirrored"] for r in runs if r["shadow_mirrored"] is not None]
    real = [r.get("shadow_real") or 0 for r in runs]

    def mean(key: str) -> str:
        vals = [r[key] for r in runs if r.get(key) is not None]
        return f"{statistics.mean(vals):.3f}" if vals else "-"

    shadow = [r.get("shadow_verdict") for r in runs]
    return (f"| {name} | {mean('agreement')} | {mean('token_agreement')} | {mean('divergence')}"
            f" | {shadow.count('Pass')}/{shadow.count('Fail')} | {verdicts.count('Promoted')} | "
            f"{verdicts.count('RolledBack')} | "
            f"{verdicts.count('Inconclusive')} | "
            f"{min(mirrored, default='-')}-{max(mirrored, default='-')} | "
            f"{max(real)} |")  # fmt: skip


def tables(out: dict[str, Any]) -> list[str]:
    """The summary per revision, then one row per run."""
    rows = ["| revision | agreement | per-token | divergence (nats/token) | shadow step pass/fail "
            "| promoted | rolled back | inconclusive | mirrored requests for the verdict | real "
            "requests before the shadow verdict (max) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    rows += [summary(name, got["runs"]) for name, got in out["revisions"].items()]
    return [*rows, "", *per_run_table(out["revisions"])]


def per_run_table(revisions: dict[str, Any]) -> list[str]:
    """One row per run: the shadow step's figures at its verdict and the rollout's end."""

    def fig(value: Any, form: str = ".3f") -> str:
        return "-" if value is None else format(value, form)

    rows = ["| revision | run | agreement | per-token | divergence | shadow step | verdict "
            "(reason, step) | mirrored at the verdict | real before it | real at the end |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, got in revisions.items():
        for i, r in enumerate(got["runs"], 1):
            why = f" ({r.get('reason')}, step {r.get('step')})" if r.get("reason") else ""
            rows.append(f"| {name} | {i} | {fig(r.get('agreement'))} | "
                        f"{fig(r.get('token_agreement'))} | {fig(r.get('divergence'), '.4f')} | "
                        f"{r.get('shadow_verdict') or '-'} | {r['verdict']}{why} | "
                        f"{fig(r.get('shadow_mirrored'), '.0f')} | "
                        f"{fig(r.get('shadow_real'), '.0f')} | "
                        f"{fig(r.get('real'), '.0f')} |")  # fmt: skip
    return rows


async def main_async(args: argparse.Namespace, engines: Any, work: Path) -> dict[str, Any]:
    from bench.gateway.shadow_quality import prompts

    base = engines.ensure_tiny_model()
    texts = prompts(args.prompts)
    spec = rollout_spec(args.share, args.min_requests, args.pause)
    out: dict[str, Any] = {"revisions": {}}
    stable_spec = engines.tiny_spec(base)
    stable_dir = Path(tempfile.mkdtemp(dir=work))
    if args.greedy:
        DECODING["temperature"] = 0
    with engines.running_vllm(stable_spec, stable_dir) as stable_url:
        bench = Bench(stable_url)
        async with bench.serving():
            for name, (directory, dtype) in variants(base, work, args.only).items():
                canary_spec = engines.tiny_spec(directory)
                canary_spec["engine"]["dtype"] = dtype
                print(f"{name}: starting its engine (load {os.getloadavg()[0]:.1f})", flush=True)
                canary_dir = Path(tempfile.mkdtemp(dir=work))
                with engines.running_vllm(canary_spec, canary_dir) as url:
                    if name == "same" and args.pairs:
                        out["ttft"] = await ttft_pairs(bench, url, texts, args,
                                                       (stable_dir, canary_dir))  # fmt: skip
                    if args.runs:
                        got = await bench_revision(bench, spec, name, url, texts, args)
                        out["revisions"][name] = got
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="rollouts per revision (10)")
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="revisions (same 4bit fewer-steps bf16; default all)",
    )
    parser.add_argument(
        "--share",
        type=float,
        default=0.1,
        help="spec.rollout.shadow.share of the rollouts (0.1, the default)",
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=50,
        help="spec.rollout.analysis.minRequests (50, the default)",
    )
    parser.add_argument("--pause", type=int, default=0, help="each step's pauseSeconds (0)")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop clients (4)")
    parser.add_argument("--prompts", type=int, default=400, help="distinct prompts (400)")
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=600.0,
        help="seconds a rollout may take before it counts Inconclusive",
    )
    parser.add_argument("--pairs", type=int, default=4, help="TTFT with/without pairs (4)")
    parser.add_argument("--window", type=float, default=30.0, help="seconds per TTFT window")
    parser.add_argument("--rate", type=float, default=4.0, help="TTFT load, requests/s (4)")
    parser.add_argument("--ttft-share", type=float, default=0.1, help="mirror share (0.1)")
    parser.add_argument("--greedy", action="store_true",
                        help="the rollouts' clients ask for temperature 0 (default: the "
                        "engine's sampling)")  # fmt: skip
    parser.add_argument("--decodings", nargs="*", default=["sampled", "greedy"],
                        help="the TTFT pairs' client decodings (sampled greedy)")  # fmt: skip
    parser.add_argument("--placements", nargs="*", default=["shared", "pinned"],
                        help="the TTFT pairs' engine placements (shared pinned)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each new verdict")
    parser.add_argument("--tables", type=Path,
                        help="only print the tables of an earlier run's --json file")  # fmt: skip
    parser.add_argument(
        "--stable-p99",
        action="store_true",
        help="instead: the shadow's cost to the stable side's TTFT p99, on the simulator "
        "(bench/gateway/canary_p99.py; flock /tmp/bench.lock)",
    )
    canary_p99.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.stable_p99:
        return canary_p99.main_p99(args)
    if args.tables:
        for row in tables(json.loads(args.tables.read_text())):
            print(row)
        return 0
    from tests.fixtures import engines

    print(f"load average {os.getloadavg()[0]:.1f}; {args.runs} runs per revision; shadow "
          f"share {args.share}, minRequests {args.min_requests}, quality gate defaults",
          flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = asyncio.run(main_async(args, engines, Path(tmp)))
    for row in tables(out):
        print(row)
    for key, pairs in out.get("ttft", {}).items():
        ratios, loads = [p["ratio"] for p in pairs], [p["load"] for p in pairs]
        extra = [p["with"]["tokens_per_request"] / max(p["without"]["tokens_per_request"], 1e-9)
                 for p in pairs]  # fmt: skip
        print(f"stable TTFT p99 with/without the shadow ({key}) at share {args.ttft_share}, "
              f"{args.rate:g} req/s, {args.window:g} s windows: ratios "
              f"{', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f},"
              f" spread {min(ratios):.3f}-{max(ratios):.3f}); engine tokens per real request "
              f"with/without {statistics.median(extra):.2f}x; load {min(loads):.1f}-"
              f"{max(loads):.1f}")  # fmt: skip
    print(json.dumps({"load_average": os.getloadavg()}))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
