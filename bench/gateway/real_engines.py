"""Routing quality on real engines: prefix-aware vs round-robin on 2 vLLM CPU replicas.

Small on purpose (a 2-core machine): two real vLLM replicas on the tiny
checkpoint (.kubellm/models/tiny, `kubellm engine tiny-model` builds it),
started once through the launcher (`python -m kubellm.engine --spec ...`);
for each contender a gateway (or `vllm-router:POLICY`) in front of them, and
a closed loop of --concurrency clients sending --prefixes system prompts x
--per-prefix questions, shuffled. Each contender gets its own fresh system
prompts, so what an earlier contender left in the engines' caches cannot help
it. Reported: prefix-cache hit rate from the engines' own counters
(vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total, the delta
over the run), and TTFT p50/p95 at the client.

    python -m bench.gateway_real_engines
    python -m bench.gateway_real_engines --policies prefix-aware,round-robin,vllm-router:cache_aware

Prints a table and writes JSON (--out, default bench/results/gateway_real_engines.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.gateway.routing import (
    Fleet,
    engine_counters,
    free_port,
    one_request,
    quantile,
    text_of_tokens,
    wait_healthy,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def tiny_spec(model_dir: Path) -> dict[str, Any]:
    """The tests' tiny CPU spec (tests/fixtures/engines.py), prefix caching on by default."""
    return {
        "model": {"source": f"file://{model_dir}", "servedName": "m"},
        "engine": {
            "dtype": "float32",
            "maxModelLen": 1024,
            "maxNumSeqs": 32,
            "blockSize": 32,
            "chunkedPrefill": {"maxNumBatchedTokens": 1024},
        },
        "resources": {"gpu": {"count": 0}},
    }


class Engines:
    """Two (--replicas) vLLM CPU servers for the whole run; SIGTERM on exit."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = tempfile.TemporaryDirectory()
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def count(self) -> int:
        return self.args.replicas

    def prefix(self, i: int) -> list[str]:
        """What replica `i`'s command line starts with (a subclass may pin it)."""
        return []

    def env(self, i: int) -> dict[str, str]:
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}

    def __enter__(self) -> Engines:
        spec = Path(self.tmp.name) / "spec.json"
        spec.write_text(json.dumps(tiny_spec(Path(self.args.model).resolve())))
        for i in range(self.count()):
            port = free_port()
            log = open(Path(self.tmp.name) / f"vllm{i}.log", "w")
            process = subprocess.Popen(
                [*self.prefix(i), sys.executable, "-m", "kubellm.engine", "--spec", str(spec),
                 "--port", str(port), "--host", "127.0.0.1"],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=self.env(i),
            )  # fmt: skip
            process.log_path = log.name  # type: ignore[attr-defined]
            self.processes.append(process)
            self.urls.append(f"http://127.0.0.1:{port}")
        for url, process in zip(self.urls, self.processes, strict=True):
            try:
                wait_healthy(url, process, timeout=self.args.start_timeout)
            except RuntimeError:
                tail = Path(process.log_path).read_text()[-3000:]  # type: ignore[attr-defined]
                print(f"{url} did not start; its log ends:\n{tail}", file=sys.stderr)
                self.__exit__()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # the launcher forwards it to vLLM
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        self.tmp.cleanup()


class Front(Fleet):
    """The gateway (or vllm-router) of gateway_routing.Fleet, over engines already running."""

    def __init__(self, args: argparse.Namespace, policy: str, engines: list[str]) -> None:
        super().__init__(args, policy)
        self.engines = list(engines)

    def __enter__(self) -> Front:
        if self.policy.startswith("vllm-router:"):
            self._start_vllm_router(self.policy.split(":", 1)[1])
            return self
        static = Path(self.tmp.name) / "static.yaml"
        static.write_text(yaml.safe_dump({"models": [
            {"name": "m", "endpoints": self.engines, "routing": {"policy": self.policy}}
        ]}))  # fmt: skip
        port = free_port()
        process = self._spawn([
            sys.executable, "-m", "kubellm.gateway.cli", "--port", str(port),
            "--static", str(static), "--scrape-interval", "0.5",
        ])  # fmt: skip
        self.gateways.append(f"http://127.0.0.1:{port}")
        wait_healthy(self.gateways[-1], process)
        return self


def prompts(args: argparse.Namespace, salt: int) -> list[list[dict[str, str]]]:
    rng = random.Random(args.seed * 1000 + salt)
    systems = [
        f"[{salt}.{k}] " + text_of_tokens(rng, args.system_tokens) for k in range(args.prefixes)
    ]
    out = [
        [{"role": "system", "content": s}, {"role": "user", "content": f"q{j}: tell me more"}]
        for s in systems
        for j in range(args.per_prefix)
    ]
    rng.shuffle(out)
    return out


async def closed_loop(url: str, work: list, args: argparse.Namespace) -> list[dict]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=args.timeout) as client:

        async def worker() -> None:
            while not queue.empty():
                messages = queue.get_nowait()
                results.append(await one_request(client, url, messages, args.max_tokens))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", default="prefix-aware,round-robin")
    p.add_argument("--model", default=str(REPO_ROOT / ".kubellm" / "models" / "tiny"))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--per-prefix", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=120, help="~4 characters each")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--gateways", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/gateway_real_engines.json")
    args = p.parse_args(argv)

    rows = []
    print(f"{'policy':24} {'ok':>4} {'hit':>6} {'ttft50':>7} {'ttft95':>7}", flush=True)
    with Engines(args) as engines:
        for salt, policy in enumerate(args.policies.split(",")):
            work = prompts(args, salt)
            with Front(args, policy, engines.urls) as front:
                q0, h0 = engine_counters(engines.urls)
                start = time.monotonic()
                results = asyncio.run(closed_loop(front.gateways[0], work, args))
                wall = time.monotonic() - start
                q1, h1 = engine_counters(engines.urls)
            ok = [r for r in results if r["ok"]]
            ttfts = [r["ttft"] for r in ok]
            row = {
                "policy": policy, "requests": len(work), "ok": len(ok), "wall_s": wall,
                "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
                "ttft_p50": quantile(ttfts, 0.5), "ttft_p95": quantile(ttfts, 0.95),
                "errors": sorted({str(r["status"]) for r in results if not r["ok"]}),
            }  # fmt: skip
            rows.append(row)
            ttft50, ttft95 = row["ttft_p50"] or 0, row["ttft_p95"] or 0
            print(f"{policy:24} {row['ok']:>4} {row['hit_rate']:>6.1%} "
                  f"{ttft50:>7.3f} {ttft95:>7.3f}", flush=True)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
