"""Routing by predicted latency on real engines: 2 vLLM CPU replicas, one given half the cores.

Issue #30's real-engine check, small on purpose (a 2-core machine): two vLLM CPU
replicas of the tiny checkpoint (.kubellm/models/tiny, `kubellm engine tiny-model`
builds it), started once through the launcher; replica 0 runs on cores 0-1 with two
OpenMP threads, replica 1 on core 1 with one (`taskset` and `VLLM_CPU_OMP_THREADS_BIND`:
--cpu-sets). Each contender gets the same arrivals with its own fresh system prompts (an
earlier contender's cached blocks cannot help it):

- kubellm's policies run in this process: the gateway's own app (`kubellm gateway
  --static`, as the CLI builds it) on a loopback port, so the bench can read what the
  latency model predicted for each answer before it learnt from it (a wrapper around
  `ReplicaModel.learn`: the prediction and the observation the ticket passed it);
- `vllm-router:POLICY`, if the `vllm-router` binary is installed (the `bench-peers`
  extra), runs in the gateway's place as in bench/gateway/real_engines.py.

Workload: Poisson arrivals at each --rates, streamed chats, prompts lognormal (median
~150 tokens, 20-700), a third after one of 2 shared system prompts of ~300 tokens, answers
8-64 tokens with `ignore_eos` (a real length, not the tiny model's early stop). The SLO
is calibrated first (--ttft/--itl override): 16 requests one at a time through
prefix-aware; targets 4x their median TTFT and 3x their median mean ITL.

Reported per policy and rate: the share of requests meeting both targets, TTFT p50/p99,
mean-ITL p99, the share of the answers replica 1 served (`r1%`, from the engines' own
`vllm:request_success_total`; which replica is the slower one is measured in the
calibration, not assumed: on the tiny model one OpenMP thread can beat two), and the
latency model's TTFT and ITL MAPE over the answers after each run's first fifth (every
kubellm policy's answers are predicted and learnt from; only slo-aware decides by them).
Figures are wall-clock on a shared machine: compare within one run, and read the load
average printed.

    python -m bench.slo_real_engines
    python -m bench.slo_real_engines --rates 2,4 --requests 60 --policies prefix-aware,slo-aware
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench import _client
from bench.gateway.real_engines import Engines, Front
from bench.gateway.routing import free_port, quantile, text_of_tokens

REPO_ROOT = Path(__file__).resolve().parents[2]


class PinnedEngines(Engines):
    """Engines whose replica i runs under `taskset -c CPUS[i]` with as many OpenMP
    threads bound (the launcher passes the environment on to vLLM)."""

    def count(self) -> int:
        return len(self.args.cpu_sets.split(","))

    def prefix(self, i: int) -> list[str]:
        return ["taskset", "-c", self.args.cpu_sets.split(",")[i]]

    def env(self, i: int) -> dict[str, str]:
        return {**super().env(i), "VLLM_CPU_OMP_THREADS_BIND": self.args.cpu_sets.split(",")[i]}


class Recorder:
    """(url, predicted TTFT, observed TTFT, predicted ITL, observed ITL) of every lesson
    the latency model learns, while installed: `Predictions.started` (the TTFT, at the
    first token) and `Predictions.answered` (the ITL, at the end) name the replica,
    `ReplicaModel.learn` returns what was predicted before it learns; a figure it was not
    given is None in its row."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float | None, float, float | None]] = []

    def __enter__(self) -> Recorder:
        from kubellm.gateway.routing.latency import model as latency
        from kubellm.gateway.routing.latency import predictions as predicted

        cls = predicted.Predictions
        self._originals = (cls.started, cls.answered, latency.ReplicaModel.learn)
        started, answered, learn = self._originals
        rows, current = self.rows, [""]

        def recorded_start(self_: Any, url: str, *rest: Any, **kw: Any) -> Any:
            current[0] = url
            return started(self_, url, *rest, **kw)

        def recorded_answer(self_: Any, labels: Any, url: str, *rest: Any) -> Any:
            current[0] = url
            return answered(self_, labels, url, *rest)

        def recorded_learn(model: Any, dispatch: Any, ttft: Any, itl: Any, *rest: Any) -> Any:
            guess = learn(model, dispatch, ttft, itl, *rest)
            if ttft is not None or itl is not None:
                rows.append((current[0], guess[0], ttft, guess[1], itl))
            return guess

        cls.started, cls.answered = recorded_start, recorded_answer  # type: ignore[method-assign]
        cls.abandoned = recorded_start  # type: ignore[method-assign]
        latency.ReplicaModel.learn = recorded_learn  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from kubellm.gateway.routing.latency import model as latency
        from kubellm.gateway.routing.latency import predictions as predicted

        cls = predicted.Predictions
        cls.started, cls.answered, latency.ReplicaModel.learn = self._originals  # type: ignore[method-assign]
        cls.abandoned = cls.started  # type: ignore[method-assign]


def served(urls: list[str]) -> list[float]:
    """Each engine's finished requests so far (`vllm:request_success_total`)."""
    out = []
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        out.append(sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "vllm:request_success_total"
        ))  # fmt: skip
    return out


class InProcessGateway:
    """`kubellm gateway --static FILE` built as the CLI builds it, served on a loopback
    port in this event loop."""

    def __init__(self, static: Path) -> None:
        self.static = static
        self.url = ""

    async def __aenter__(self) -> InProcessGateway:
        import uvicorn
        from kubellm.gateway import cli
        from kubellm.gateway.http import server
        from kubellm.gateway.http.app import Gateway, create_app
        from kubellm.gateway.routing import flags
        from kubellm.gateway.routing.latency import metrics as slo

        port = free_port()
        parser = argparse.ArgumentParser()
        cli.configure(parser)
        args = parser.parse_args(
            ["--port", str(port), "--static", str(self.static), "--scrape-interval", "0.5"]
        )
        metrics = slo.create()
        self.gateway = Gateway(flags.discovery(args), cli.settings_from(args), metrics=metrics)
        config = server.config(
            create_app(self.gateway), server.ClientLimits(), lambda: None,
            host="127.0.0.1", port=port, log_level="warning",
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.task = asyncio.create_task(self.server.serve())
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(timeout=5) as client:
            while time.monotonic() < deadline:
                try:
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError("the in-process gateway did not become ready in 60 s")

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 30)


def workload(args: argparse.Namespace, salt: int, count: int) -> list[dict[str, Any]]:
    """`count` requests: messages, max_tokens, and the arrival gap before each."""
    rng = random.Random(args.seed)  # the same lengths and arrivals for every contender
    words = random.Random(args.seed * 1000 + salt)  # fresh text per contender
    systems = [f"[{salt}.{k}] " + text_of_tokens(words, 300) for k in range(2)]
    out = []
    for i in range(count):
        tokens = int(min(max(rng.lognormvariate(math.log(150), 0.8), 20), 700))
        question = f"[{salt}.q{i}] " + text_of_tokens(words, tokens)
        messages = [{"role": "user", "content": question}]
        if rng.random() < 1 / 3:
            messages.insert(0, {"role": "system", "content": rng.choice(systems)})
        out.append({
            "messages": messages,
            "max_tokens": rng.randint(8, 64),
            "gap": rng.expovariate(1.0),  # scaled by the rate
        })  # fmt: skip
    return out


async def one(client: httpx.AsyncClient, url: str, item: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat (`bench._client`); `itl` None for a one-token answer."""
    body = {"model": "m", "messages": item["messages"], "max_tokens": item["max_tokens"],
            "ignore_eos": True}  # fmt: skip
    out = await _client.stream(client, url, body)
    if out["ok"] and out["tokens"] < 2:
        out["itl"] = None
    return out


async def drive(url: str, work: list[dict[str, Any]], rate: float, timeout: float) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = []
        for item in work:
            tasks.append(asyncio.create_task(one(client, url, item)))
            await asyncio.sleep(item["gap"] / rate)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout * 2))


def mape(pairs: list[tuple[float, float]]) -> float | None:
    pairs = [(p, y) for p, y in pairs if y and y > 0]
    return statistics.fmean(abs(p - y) / y for p, y in pairs) if pairs else None


def static_file(work: Path, policy: str, urls: list[str], ttft: float, itl: float) -> Path:
    path = work / f"static-{policy}.yaml"
    path.write_text(yaml.safe_dump({"models": [{
        "name": "m", "endpoints": urls, "routing": {"policy": policy},
        "slo": {"ttftSeconds": ttft, "itlSeconds": itl},
    }]}))  # fmt: skip
    return path


async def run_kubellm(
    policy: str, static: Path, work: list[dict[str, Any]], rate: float, timeout: float
) -> tuple[list[dict], list[tuple]]:
    with Recorder() as recorder:
        async with InProcessGateway(static) as gateway:
            results = await drive(gateway.url, work, rate, timeout)
    return results, recorder.rows


async def calibrate(static: Path, work: list[dict[str, Any]]) -> tuple[list[dict], list[tuple]]:
    """The requests one at a time on the idle pool, and what each replica's answers took."""
    with Recorder() as recorder:
        async with InProcessGateway(static) as gateway, httpx.AsyncClient(timeout=60) as client:
            return [await one(client, gateway.url, item) for item in work], recorder.rows


def summarize(
    results: list[dict], rows: list[tuple], ttft: float, itl: float, slow_share: float | None
) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    met = [r for r in ok if r["ttft"] <= ttft and (r["itl"] or 0) <= itl]
    warm = rows[len(rows) // 5 :]  # the model's lessons once it has had a fifth of them
    return {
        "requests": len(results),
        "ok": len(ok),
        "slo_share": len(met) / len(results) if results else 0.0,
        "ttft_p50": quantile([r["ttft"] for r in ok], 0.5),
        "ttft_p99": quantile([r["ttft"] for r in ok], 0.99),
        "itl_p99": quantile([r["itl"] for r in ok if r["itl"] is not None], 0.99),
        "slow_share": slow_share,
        "ttft_mape": mape([(p, y) for _, p, y, _, _ in warm if y]) if warm else None,
        "itl_mape": mape([(p, y) for _, _, _, p, y in warm if y]) if warm else None,
        "errors": sorted({str(r["status"]) for r in results if not r["ok"]}),
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", default="prefix-aware,slo-aware,least-load,"
                   "vllm-router:power_of_two,vllm-router:cache_aware")  # fmt: skip
    p.add_argument("--rates", default="2,4,6", help="requests per second")
    p.add_argument("--requests", type=int, default=60, help="per policy, rate and repeat")
    p.add_argument("--repeats", type=int, default=2, help="runs per policy and rate")
    p.add_argument("--cpu-sets", default="0-1,1", help="taskset CPU list per replica")
    p.add_argument("--ttft", type=float, help="TTFT target, s (default: calibrated)")
    p.add_argument("--itl", type=float, help="mean-ITL target, s (default: calibrated)")
    p.add_argument("--model", default=str(REPO_ROOT / ".kubellm" / "models" / "tiny"))
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--gateways", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--replicas", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/slo_real_engines.json")
    args = p.parse_args(argv)
    # SIGTERM (a timeout, a kill) unwinds the `with` blocks: no engine outlives the bench
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    policies = args.policies.split(",")
    have_router = any(
        Path(sys.executable).with_name("vllm-router").exists() or os.path.exists(d)
        for d in [os.path.join(x, "vllm-router") for x in os.environ["PATH"].split(":")]
    )
    if not have_router:
        dropped = [q for q in policies if q.startswith("vllm-router:")]
        if dropped:
            print(f"vllm-router not installed (pip install -e '.[bench-peers]'): "
                  f"skipping {', '.join(dropped)}")  # fmt: skip
        policies = [q for q in policies if not q.startswith("vllm-router:")]
    rates = [float(r) for r in args.rates.split(",")]
    rows: list[dict[str, Any]] = []
    work_dir = Path(tempfile.mkdtemp(prefix="kubellm-slo-real-"))
    with PinnedEngines(args) as engines:
        urls = engines.urls
        ttft, itl = args.ttft, args.itl
        if ttft is None or itl is None:  # calibrate on the idle pool, one at a time
            static = static_file(work_dir, "prefix-aware", urls, 60, 1)
            results, seen = asyncio.run(calibrate(static, workload(args, salt=999, count=16)))
            for i, url in enumerate(urls):  # which replica is the slower one, measured
                mine = [row for row in seen if row[0] == url]
                itls = [row[4] for row in mine if row[4]]
                ttfts = [row[2] for row in mine if row[2]]
                print(f"replica {i} (cpus {args.cpu_sets.split(',')[i]}): {len(itls)} answers, "
                      f"median TTFT {fmt(median(ttfts), '.4f')} s, "
                      f"median ITL {fmt(median(itls), '.4f')} s")  # fmt: skip
            ok = [r for r in results if r["ok"]]
            if not ok:
                raise SystemExit(f"calibration failed: {results}")
            ttft = ttft or 4 * statistics.median(r["ttft"] for r in ok)  # calibrated SLO
            itl = itl or 3 * statistics.median(r["itl"] for r in ok if r["itl"])
        load = os.getloadavg()[0]
        print(f"SLO: TTFT {ttft:.3f} s, mean ITL {itl:.4f} s; load average {load:.1f}")
        print(f"{'policy':26} {'rate':>5} {'rep':>3} {'ok':>4} {'SLO%':>6} {'TTFT50':>7} "
              f"{'TTFT99':>7} {'ITL99':>7} {'r1%':>6} {'MAPE-T':>7} {'MAPE-I':>7}",
              flush=True)  # fmt: skip
        runs = [
            (rate, repeat, policy)
            for rate in rates
            for repeat in range(args.repeats)
            # odd repeats in reverse order: a drift in the machine's load over a rate's
            # runs falls on every policy alike (ABBA)
            for policy in (policies if repeat % 2 == 0 else policies[::-1])
        ]
        for salt, (rate, repeat, policy) in enumerate(runs):
            work = workload(args, salt=salt, count=args.requests)
            before = served(urls)
            if policy.startswith("vllm-router:"):
                with Front(args, policy, urls) as front:
                    results = asyncio.run(drive(front.gateways[0], work, rate, args.timeout))
                recorded: list[tuple] = []
            else:
                static = static_file(work_dir, policy, urls, ttft, itl)
                results, recorded = asyncio.run(
                    run_kubellm(policy, static, work, rate, args.timeout)
                )
            after = served(urls)
            done = [b - a for a, b in zip(before, after, strict=True)]
            slow_share = done[-1] / sum(done) if sum(done) else None
            row = {"policy": policy, "rate": rate, "repeat": repeat,
                   "load": os.getloadavg()[0],
                   **summarize(results, recorded, ttft, itl, slow_share)}  # fmt: skip
            rows.append(row)
            print(f"{policy:26} {rate:5.1f} {repeat:>3} {row['ok']:>4} "
                  f"{100 * row['slo_share']:5.1f}% "
                  f"{fmt(row['ttft_p50'], '7.3f')} {fmt(row['ttft_p99'], '7.3f')} "
                  f"{fmt(row['itl_p99'], '7.4f')} "
                  f"{fmt(row['slow_share'] and 100 * row['slow_share'], '5.1f')}% "
                  f"{fmt(row['ttft_mape'] and 100 * row['ttft_mape'], '6.1f')}% "
                  f"{fmt(row['itl_mape'] and 100 * row['itl_mape'], '6.1f')}%",
                  flush=True)  # fmt: skip
    print(f"\nmean over {args.repeats} repeats: SLO share, TTFT MAPE")
    for rate in rates:
        for policy in policies:
            mine = [r for r in rows if r["rate"] == rate and r["policy"] == policy]
            share = statistics.fmean(r["slo_share"] for r in mine)
            mapes = [r["ttft_mape"] for r in mine if r["ttft_mape"] is not None]
            mape_text = f"{100 * statistics.fmean(mapes):5.1f}%" if mapes else "    -"
            print(f"{policy:26} {rate:5.1f} {100 * share:5.1f}% {mape_text}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "slo": [ttft, itl], "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
