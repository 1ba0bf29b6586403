"""Tenancy: batch interference and fair shares, with tenants (flow control) and without
(today's gateway), in the same run on the same simulated fleet. Contenders (--order):
`tenants` (flow control with the prefill hold and --headroom-prefill-rate), `before` (flow
control as it was before those two: no hold, no prefill budget), `today` (no tenants); first
`shipped` (the tenants file and no other flag: since 2026-12-03 the fair in-flight budget is
derived from the pool by default, `flow.fair_capacity`) and `off` (the same with
`--fair-in-flight-tokens off`, the shipped defaults before); `unpaced` (`--headroom-prefill-rate
off`: the shipped defaults before the prefill budget at each replica's learnt prefill speed
became the default, late 2026-12-03). bench/simulation/tenancy_sim.py runs the
fairness phase on a simulated clock (no processes), over workloads the default was not
chosen on.

Four simulated replicas (kubellm.engine's simulator, profile llama-3.1-8b-h100, spec
`maxNumSeqs: 16`: 64 slots in all) behind one gateway process; each contender gets fresh
replicas. Figures are in simulated seconds (--time-scale S: the simulator and the load run
S times slower than real time, so this 2-core machine keeps up; figures are divided by S).

- **interference**: an interactive tenant (priority 10) sends streamed chats (~450-token
  prompts, 100-token answers) at a Poisson --rate; a batch tenant (priority -1) keeps
  --batch-outstanding long requests (1,000-token prompts, 300-token answers, not streamed)
  outstanding. Three phases per contender: interactive alone, batch alone, both. Printed:
  the interactive TTFT p50/p99 alone and with the batch load (target: at most 2x), the
  requests refused or failed (target: none), and the output tokens/s with both over the
  batch tenant's alone (target: >= 90%). Then where the interactive tail was: the
  gateway's own TTFT and admission-wait p99 for the interactive tenant (its histograms,
  wall time / S: the client's lag excluded) and the engines' TTFT p99 (every request, on
  the simulator's clock: no process's lag in it).
- **fairness**: three tenants of equal weight, each keeping --fair-outstanding requests
  outstanding, with 200-, 2,000- and 8,000-token prompts and 100-token answers; each
  tenant's service (prompt tokens + 2 x output tokens, the VTC paper's measure) as a share
  of the total, and Jain's index (target: >= 0.98, each share within 10% of a third). Both
  contenders keep at most 16 requests per replica at the gateway (--max-in-flight 16; set by
  --fair-in-flight), so the rest waits there: FIFO today, by virtual token counter with
  tenants.
- **join**: the three fairness tenants backlogged, a fourth (2,000-token prompts, the same
  weight) joins after --join-after simulated s: how long until its share of the service
  finished in a --join-window (5 s) reaches 90% of an equal quarter (target: within 10 s),
  and its share over the rest of the run. Same in-flight cap as the fairness scenario.
- **quota** (`--scenarios quota`): a tenant offering 3x its tokensPerMinute through two
  gateways that share one Redis (redis-server on loopback) for --quota-seconds of wall time
  (quotas count real minutes): the tokens it is served per minute against its quota
  (target: within 5%), and another tenant's TTFT without and with that load.

    python -m bench.tenancy                       # interference, fairness, join; both contenders
    python -m bench.tenancy --scenarios fairness --seconds 60

Prints the tables and writes JSON (--out, default bench/results/tenancy.json).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench import _client
from kubellm.bench.stats import percentile
from kubellm.fleet.processes import free_port

WORDS = ["tenant", "batch", "chat", "fleet", "prompt", "answer", "team", "quota", "share",
         "support", "ticket", "query", "summary", "contract", "invoice", "report"]  # fmt: skip


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: process exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url}: not healthy after {timeout} s")


def key(name: str) -> str:
    return f"sk-bench-{name}"


def prompt(rng: random.Random, tokens: int, tag: str) -> str:
    """About `tokens` tokens (the simulator counts ~4 characters a token), unique."""
    words: list[str] = [tag]
    chars = len(tag)
    while chars < 4 * tokens:
        word = rng.choice(WORDS)
        words.append(word)
        chars += len(word) + 1
    return " ".join(words)


class Fleet:
    """Simulated replicas and one gateway, in processes; stopped on exit."""

    def __init__(self, args: argparse.Namespace, tenants: list[dict] | None, extra: list[str],
                 ttft: float) -> None:  # fmt: skip
        self.args, self.tenants, self.extra, self.ttft = args, tenants, extra, ttft
        self.processes: list[subprocess.Popen] = []
        self.engines: list[str] = []
        self.gateway = ""
        self.metrics = ""  # the gateway's /metrics (its own port: tenants keep it off the API's)
        self.tmp = tempfile.TemporaryDirectory()

    def _spawn(self, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(Path(self.tmp.name) / f"p{len(self.processes)}.log", "w")  # noqa: SIM115
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.processes.append(process)
        return process

    def __enter__(self) -> Fleet:
        a, tmp = self.args, Path(self.tmp.name)
        spec = {
            "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "m"},
            "spec": {"model": {"source": "hf://org/base", "servedName": "m"},
                     "engine": {"maxNumSeqs": a.max_num_seqs},
                     "resources": {"gpu": {"count": 1}}},
        }  # fmt: skip
        if a.engine == "vllm":  # the tests' tiny checkpoint on vLLM's CPU backend
            spec["spec"] = {
                "model": {"source": f"file://{Path(a.model).resolve()}", "servedName": "m"},
                "engine": {"dtype": "float32", "maxModelLen": 1024, "blockSize": 32,
                           "maxNumSeqs": a.max_num_seqs,
                           "chunkedPrefill": {"maxNumBatchedTokens": 1024}},
                "resources": {"gpu": {"count": 0}},
            }  # fmt: skip
        (tmp / "spec.json").write_text(json.dumps(spec))
        for _ in range(a.replicas):
            port = free_port()
            if a.engine == "vllm":
                process = self._spawn([
                    sys.executable, "-m", "kubellm.engine", "--spec", str(tmp / "spec.json"),
                    "--port", str(port), "--host", "127.0.0.1",
                ], env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
            else:
                process = self._spawn([
                    sys.executable, "-m", "kubellm.engine", "--backend", "sim",
                    "--port", str(port), "--spec", str(tmp / "spec.json"),
                    "--profile", a.profile, "--time-scale", str(a.time_scale),
                ])  # fmt: skip
            self.engines.append(f"http://127.0.0.1:{port}")
            wait_healthy(self.engines[-1], process, timeout=300 if a.engine == "vllm" else 60)
        (tmp / "static.yaml").write_text(yaml.safe_dump({"models": [{
            "name": "m", "endpoints": self.engines, "routing": {"policy": "least-load"},
            "slo": {"ttftSeconds": self.ttft * a.time_scale,
                    "itlSeconds": a.itl_slo * a.time_scale},
        }]}))  # fmt: skip
        port, metrics_port = free_port(), free_port()
        self.metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        command = [
            sys.executable, "-m", "kubellm.gateway.cli", "--port", str(port),
            "--metrics-port", str(metrics_port),
            "--static", str(tmp / "static.yaml"), "--scrape-interval", "0.25", *self.extra,
        ]  # fmt: skip
        if self.tenants is not None:
            for t in self.tenants:
                t["apiKeys"] = [f"sha256:{hashlib.sha256(key(t['name']).encode()).hexdigest()}"]
            (tmp / "tenants.yaml").write_text(yaml.safe_dump({"tenants": self.tenants}))
            command += ["--tenants", str(tmp / "tenants.yaml"),
                        "--band-ttl", str(a.band_ttl * a.time_scale)]  # fmt: skip
        process = self._spawn(command)
        self.gateway = f"http://127.0.0.1:{port}"
        wait_healthy(self.gateway, process)
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        self.tmp.cleanup()


def refusal(response: httpx.Response, tenant: str) -> dict[str, Any]:
    """A refused request: its status and flow control's reason (`x-kubellm-drop-reason`:
    shed, ttl, band-full, queue-full; none: the pass's own `saturated`)."""
    reason = response.headers.get("x-kubellm-drop-reason") or "saturated"
    status = response.status_code
    return {"ok": False, "status": f"{status} {reason}" if status == 429 else status,
            "tenant": tenant}  # fmt: skip


async def one(client: httpx.AsyncClient, url: str, tenant: str, text: str, max_tokens: int,
              stream: bool) -> dict[str, Any]:  # fmt: skip
    """One chat request; TTFT (first content event, or the whole answer) and tokens
    (streamed: through `bench._client`)."""
    body = {"model": "m", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "stream": stream}  # fmt: skip
    headers = {"authorization": f"Bearer {key(tenant)}"}
    if stream:
        out = await _client.stream(client, url, body, headers=headers)
        if "response" in out:
            return refusal(out["response"], tenant)
        return {**out, "tenant": tenant}
    start = time.monotonic()
    try:
        response = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    except httpx.HTTPError as error:
        return {"ok": False, "status": type(error).__name__, "tenant": tenant}
    if response.status_code != 200:
        return refusal(response, tenant)
    first = time.monotonic()
    usage = response.json().get("usage", {})
    tokens = int(usage.get("completion_tokens") or 0)
    total = int(usage.get("total_tokens") or 0)
    return {"ok": True, "tenant": tenant, "ttft": first - start, "tokens": tokens,
            "total": total, "end": first}  # fmt: skip


async def poisson(client, url, tenant, rate, until, rng, tokens, answer, results):  # type: ignore[no-untyped-def]
    tasks = []
    i = 0
    while time.monotonic() < until:
        text = prompt(rng, tokens, f"{tenant} {i} {rng.random()}")
        tasks.append(asyncio.create_task(one(client, url, tenant, text, answer, True)))
        i += 1
        await asyncio.sleep(rng.expovariate(rate))
    results.extend(await asyncio.gather(*tasks))


async def closed(client, url, tenant, outstanding, until, rng, tokens, answer, stream, results):  # type: ignore[no-untyped-def]
    async def worker(w: int) -> None:
        i = 0
        while time.monotonic() < until:
            text = prompt(rng, tokens, f"{tenant} {w} {i} {rng.random()}")
            results.append(await one(client, url, tenant, text, answer, stream))
            i += 1

    await asyncio.gather(*(worker(w) for w in range(outstanding)))


def client(args: argparse.Namespace) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=400)
    return httpx.AsyncClient(timeout=args.timeout * args.time_scale, limits=limits)


async def phase(args: argparse.Namespace, url: str, interactive: bool, batch: bool,
                seed: int) -> dict[str, Any]:  # fmt: skip
    s = args.time_scale
    rng = random.Random(seed)
    chat: list[dict] = []
    bulk: list[dict] = []
    start = time.monotonic()
    until = start + args.seconds * s
    async with client(args) as c:
        work = []
        if interactive:
            tokens, answer = args.interactive_tokens, args.interactive_answer
            work.append(poisson(c, url, "interactive", args.rate / s, until, rng, tokens,
                                answer, chat))  # fmt: skip
        if batch:
            work.append(closed(c, url, "batch", args.batch_outstanding, until, rng,
                               args.batch_tokens, args.batch_answer, False, bulk))  # fmt: skip
        await asyncio.gather(*work)
    wall = (time.monotonic() - start) / s
    ttfts = [r["ttft"] / s for r in chat if r["ok"]]
    served = [r for r in chat + bulk if r["ok"] and r["end"] <= until]
    return {
        "ttft_p50": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99": percentile(ttfts, 99) if ttfts else None,
        "interactive": len(chat), "interactive_refused": sum(not r["ok"] for r in chat),
        "batch": len(bulk), "batch_refused": sum(not r["ok"] for r in bulk),
        "refusals": {who: _count(str(r["status"]) for r in rs if not r["ok"])
                     for who, rs in (("interactive", chat), ("batch", bulk))},
        "output_tokens_per_s": sum(r["tokens"] for r in served) / (args.seconds),
        "seconds": wall,
    }  # fmt: skip


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


async def warm_up(args: argparse.Namespace, url: str) -> None:
    """A few uncounted requests per replica first (connections, the first uses)."""
    rng = random.Random(0)
    async with client(args) as c:
        await asyncio.gather(*(
            one(c, url, "interactive", prompt(rng, args.interactive_tokens, f"warm {i}"), 20, True)
            for i in range(4 * args.replicas)
        ))  # fmt: skip


def snapshot(fleet: Fleet) -> dict[str, dict[tuple, float]]:
    """Histogram buckets now: the gateway's per-tenant TTFT and admission wait (wall s) and
    the engines' own TTFT, all requests (simulated s, the simulator's clock: no process's
    lag in it), summed over the replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"kubellm_gateway_tenant_time_to_first_token_seconds_bucket",
              "kubellm_gateway_tenant_queue_seconds_bucket",
              "vllm:time_to_first_token_seconds_bucket"}  # fmt: skip
    out: dict[str, dict[tuple, float]] = {}
    for url in [fleet.metrics, *(f"{e}/metrics" for e in fleet.engines)]:
        text = httpx.get(url, timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    key = (sample.labels.get("tenant", ""), float(sample.labels["le"]))
                    found = out.setdefault(sample.name, {})
                    found[key] = found.get(key, 0.0) + sample.value
    return out


def delta_p99(before: dict, after: dict, name: str, tenant: str = "") -> float | None:
    """The p99 of what a histogram counted between two snapshots."""
    from kubellm.metrics import histogram_quantile

    a, b = after.get(name, {}), before.get(name, {})
    buckets = [(le, v - b.get((t, le), 0.0)) for (t, le), v in a.items() if t == tenant]
    return histogram_quantile(0.99, buckets)


def diagnosed(args: argparse.Namespace, fleet: Fleet, work: Any) -> dict[str, Any]:
    """Run one phase and say where the interactive tail was: the gateway's TTFT and
    admission wait for the interactive tenant (with tenants), the engines' own TTFT."""
    before = snapshot(fleet)
    row = asyncio.run(work)
    after = snapshot(fleet)
    s = args.time_scale
    gw = delta_p99(before, after, "kubellm_gateway_tenant_time_to_first_token_seconds_bucket",
                   "interactive")  # fmt: skip
    wait = delta_p99(before, after, "kubellm_gateway_tenant_queue_seconds_bucket", "interactive")
    row["gateway_ttft_p99"] = None if gw is None else gw / s
    row["gateway_wait_p99"] = None if wait is None else wait / s
    row["engine_ttft_p99"] = delta_p99(before, after, "vllm:time_to_first_token_seconds_bucket")
    return row


# The gateways compared: today's (no tenants); with tenants, the prefill hold and the
# prefill budget (--headroom-prefill-rate); and with tenants as before those two (flow.py).
CONTENDERS = ("shipped", "unpaced", "off", "fair", "tenants", "before", "today")


def contender(name: str, tenants: list[dict],
              args: argparse.Namespace) -> tuple[list[dict] | None, list[str]]:  # fmt: skip
    """A contender's tenants (None: today's gateway) and its gateway flags."""
    if name == "today":
        return None, []
    if name == "shipped":  # the tenants file and no other flag: the shipped defaults
        return tenants, []
    if name == "unpaced":  # the shipped defaults until the learnt prefill budget (2026-12-03)
        return tenants, ["--headroom-prefill-rate", "off"]
    if name == "off":  # the shipped defaults before 2026-12-03: no fair in-flight budget
        return tenants, ["--fair-in-flight-tokens", "off"]
    if name == "before":
        return tenants, ["--no-headroom-hold-prefill"]
    if name == "fair":  # tenants with the fair in-flight budget (flow.py)
        rate = args.headroom_prefill_rate / args.time_scale
        return tenants, ["--headroom-prefill-rate", f"{rate:g}",
                         "--fair-in-flight-tokens", f"{args.fair_in_flight_tokens:g}"]  # fmt: skip
    if name == "tenants":
        rate = args.headroom_prefill_rate / args.time_scale  # simulated tokens/s to wall
        return tenants, ["--headroom-prefill-rate", f"{rate:g}"]
    raise SystemExit(f"--order: {name!r} is not one of {', '.join(CONTENDERS)}")


def interference(args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    rows = []
    tenants = [{"name": "interactive", "priority": 10}, {"name": "batch", "priority": -1}]
    for name in args.order.split(","):
        declared, extra = contender(name, tenants, args)
        if declared is not None and name != "shipped":
            extra = [*extra, "--headroom-load", str(args.headroom_load)]
        with Fleet(args, [dict(t) for t in declared] if declared else None, extra,
                   args.ttft_slo) as fleet:  # fmt: skip
            asyncio.run(warm_up(args, fleet.gateway))
            alone = diagnosed(args, fleet, phase(args, fleet.gateway, True, False, seed))
            batch = diagnosed(args, fleet, phase(args, fleet.gateway, False, True, seed + 1))
            both = diagnosed(args, fleet, phase(args, fleet.gateway, True, True, seed + 2))
        rows.append({"contender": name, "seed": seed, "alone": alone, "batch_alone": batch,
                     "both": both})  # fmt: skip
    return rows


async def fair_phase(args: argparse.Namespace, url: str, seed: int) -> dict[str, Any]:
    s = args.time_scale
    rng = random.Random(seed)
    sizes = fair_sizes(args)
    results: dict[str, list[dict]] = {t: [] for t in sizes}
    start = time.monotonic()
    until = start + args.seconds * s
    async with client(args) as c:
        await asyncio.gather(*(
            closed(c, url, t, args.fair_outstanding, until, rng, n, 100, False, results[t])
            for t, n in sizes.items()
        ))  # fmt: skip
    done = {t: [r for r in rs if r["ok"] and r["end"] <= until] for t, rs in results.items()}
    service = {t: sum(sizes[t] + 2 * r["tokens"] for r in rs) for t, rs in done.items()}
    total = sum(service.values()) or 1
    shares = {t: v / total for t, v in service.items()}
    weights = fair_weights(args)
    # Jain's index of the shares over the weights (equal weights: the plain index)
    values = [shares[t] / weights[t] for t in shares]
    jain = sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0
    refused = sum(not r["ok"] for rs in results.values() for r in rs)
    statuses: dict[str, int] = {}
    for rs in results.values():
        for r in rs:
            if not r["ok"]:
                statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    seconds = args.seconds
    return {"shares": shares, "jain": jain, "refused": refused, "statuses": statuses,
            "service_per_s": total / seconds,
            "prompt_per_s": sum(sizes[t] * len(rs) for t, rs in done.items()) / seconds,
            "output_per_s": sum(r["tokens"] for rs in done.values() for r in rs) / seconds,
            }  # fmt: skip


def fair_sizes(args: argparse.Namespace) -> dict[str, int]:
    """The fairness tenants' prompt tokens (--fair-sizes small,medium,large)."""
    values = [int(x) for x in args.fair_sizes.split(",")]
    return dict(zip(("small", "medium", "large"), values, strict=True))


def fair_weights(args: argparse.Namespace) -> dict[str, float]:
    """The fairness tenants' weights (--fair-weights small,medium,large)."""
    values = [float(x) for x in args.fair_weights.split(",")]
    return dict(zip(("small", "medium", "large"), values, strict=True))


def fairness(args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    rows = []
    weights = fair_weights(args)
    tenants = [{"name": n, "priority": 0, "weight": w} for n, w in weights.items()]
    extra = ["--max-in-flight", str(args.fair_in_flight or args.max_num_seqs)]
    for name in args.order.split(","):
        declared, flags = contender(name, tenants, args)
        if name != "shipped":
            flags = [*extra, *flags]
        with Fleet(args, [dict(t) for t in declared] if declared else None, flags,
                   args.seconds * 2) as fleet:  # fmt: skip
            row = asyncio.run(fair_phase(args, fleet.gateway, seed))
            row["waited"] = mean_waits(fleet)
        rows.append({"contender": name, "seed": seed, **row})
    return rows


def mean_waits(fleet: Fleet) -> dict[str, float]:
    """Each tenant's mean admission wait at the gateway (simulated s): a tenant that never
    waits there is not backlogged at the gateway, and no order of the queue serves it more."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    name = "kubellm_gateway_tenant_queue_seconds"
    for family in text_string_to_metric_families(httpx.get(fleet.metrics).text):
        for sample in family.samples:
            tenant = sample.labels.get("tenant")
            if sample.name == f"{name}_sum":
                sums[tenant] = sample.value
            elif sample.name == f"{name}_count":
                counts[tenant] = sample.value
    scale = fleet.args.time_scale
    return {t: sums.get(t, 0.0) / counts[t] / scale for t in counts if counts[t]}


async def join_phase(args: argparse.Namespace, url: str, seed: int) -> dict[str, Any]:
    """The three fairness tenants backlogged; a fourth (2,000-token prompts) joins after
    --join-after simulated s and stays backlogged for --join-seconds. Its share of the
    service finished in each --join-window (sliding by a tenth of it) against an equal
    quarter: how long after joining the first window ends at which it holds at least 90%
    of a quarter, and its share over the rest of the run."""
    s = args.time_scale
    rng = random.Random(seed)
    sizes = {"small": 200, "medium": 2000, "large": 8000, "late": 2000}
    results: dict[str, list[dict]] = {t: [] for t in sizes}
    start = time.monotonic()
    joined = start + args.join_after * s
    until = joined + args.join_seconds * s

    async def late(c: httpx.AsyncClient) -> None:
        await asyncio.sleep(joined - time.monotonic())
        await closed(c, url, "late", args.fair_outstanding, until, rng, sizes["late"], 100,
                     False, results["late"])  # fmt: skip

    async with client(args) as c:
        await asyncio.gather(late(c), *(
            closed(c, url, t, args.fair_outstanding, until, rng, n, 100, False, results[t])
            for t, n in sizes.items() if t != "late"
        ))  # fmt: skip
    done = [(r["end"], t, sizes[t] + 2 * r["tokens"])
            for t, rs in results.items() for r in rs if r["ok"] and r["end"] <= until]  # fmt: skip
    window = args.join_window * s
    reached = None
    end = joined + window
    while end <= until:
        served = {t: 0.0 for t in sizes}
        for at, t, service in done:
            if end - window < at <= end:
                served[t] += service
        total = sum(served.values())
        if total and served["late"] / total >= 0.9 / len(sizes):
            reached = (end - joined) / s
            break
        end += window / 10
    after = joined + min(2 * window, (until - joined) / 2)
    rest = {t: sum(v for at, u, v in done if u == t and at > after) for t in sizes}
    total = sum(rest.values()) or 1
    return {"reached_s": reached, "late_share_after": rest["late"] / total,
            "shares_after": {t: v / total for t, v in rest.items()},
            "after_s": (after - joined) / s,
            "refused": sum(not r["ok"] for rs in results.values() for r in rs)}  # fmt: skip


def joining(args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    rows = []
    tenants = [{"name": n, "priority": 0} for n in ("small", "medium", "large", "late")]
    extra = ["--max-in-flight", str(args.fair_in_flight or args.max_num_seqs)]
    for name in args.order.split(","):
        declared, flags = contender(name, tenants, args)
        timeout = (args.join_after + args.join_seconds) * 2
        with Fleet(args, [dict(t) for t in declared] if declared else None, [*extra, *flags],
                   timeout) as fleet:  # fmt: skip
            row = asyncio.run(join_phase(args, fleet.gateway, seed))
        rows.append({"contender": name, "seed": seed, **row})
    return rows


def start_redis(tmp: str) -> tuple[subprocess.Popen, str]:
    import shutil

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("the quota scenario needs redis-server (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.1)
    raise SystemExit("redis-server did not answer")


def quota(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """A metered tenant offers 3x its tokensPerMinute through two gateways sharing one
    Redis, for --quota-seconds of wall time (quotas count real minutes); another tenant's
    TTFT with and without that load. Served: the tokens of its 200 answers (usage)."""
    tpm = args.quota_tpm
    tenants = [{"name": "metered", "priority": 0, "tokensPerMinute": tpm},
               {"name": "other", "priority": 0}]  # fmt: skip
    per_request = 400 + 100  # ~400 prompt tokens + 100 output
    offered_rps = 3 * tpm / 60 / per_request
    with tempfile.TemporaryDirectory() as tmp:
        redis, url = start_redis(tmp)
        try:
            extra = ["--quota-redis", url]
            with Fleet(args, [dict(t) for t in tenants], extra, args.ttft_slo) as fleet:
                port = free_port()
                second = subprocess.Popen(
                    [sys.executable, "-m", "kubellm.gateway.cli", "--port", str(port),
                     "--static", str(Path(fleet.tmp.name) / "static.yaml"),
                     "--tenants", str(Path(fleet.tmp.name) / "tenants.yaml"), *extra],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                fleet.processes.append(second)
                urls = [fleet.gateway, f"http://127.0.0.1:{port}"]
                wait_healthy(urls[1], second)

                async def run(metered: bool, seconds: float) -> dict[str, Any]:
                    rng = random.Random(seed)
                    out: list[dict] = []
                    other: list[dict] = []
                    until = time.monotonic() + seconds
                    async with client(args) as c:

                        async def offer() -> None:
                            tasks, i = [], 0
                            while time.monotonic() < until:
                                text = prompt(rng, 400, f"metered {i} {rng.random()}")
                                tasks.append(
                                    asyncio.create_task(
                                        one(c, urls[i % 2], "metered", text, 100, False)
                                    )
                                )
                                i += 1
                                await asyncio.sleep(rng.expovariate(offered_rps))
                            out.extend(await asyncio.gather(*tasks))

                        work = [poisson(c, urls[0], "other", args.rate / 4 / args.time_scale,
                                        until, rng, 450, 100, other)]  # fmt: skip
                        if metered:
                            work.append(offer())
                        await asyncio.gather(*work)
                    served = sum(r.get("total", 0) for r in out if r["ok"])
                    ttfts = [r["ttft"] / args.time_scale for r in other if r["ok"]]
                    return {"served_per_minute": served / (seconds / 60),
                            "refused_429": sum(r.get("status") == 429 for r in out),
                            "metered": len(out),
                            "other_p50": percentile(ttfts, 50),
                            "other_p99": percentile(ttfts, 99)}  # fmt: skip

                base = asyncio.run(run(False, args.quota_seconds / 2))
                # start on a minute's boundary, so the run covers whole quota windows
                time.sleep(60 - time.time() % 60)
                loaded = asyncio.run(run(True, args.quota_seconds))
        finally:
            redis.terminate()
            redis.wait(10)
    return {"seed": seed, "tpm": tpm, "offered_per_minute": 3 * tpm, "alone": base,
            "loaded": loaded}  # fmt: skip


def fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", default="interference,fairness,join")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--profile", default="llama-3.1-8b-h100")
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--seconds", type=float, default=20.0, help="simulated s per phase")
    parser.add_argument("--rate", type=float, default=8.0, help="interactive requests/sim s")
    parser.add_argument("--batch-outstanding", type=int, default=64)
    parser.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        default="sim",
        help="sim: kubellm.engine's simulator (--profile); vllm: real vLLM CPU servers on the "
        "tests' tiny checkpoint (--model; maxModelLen 1024: shrink the sizes below, and use "
        "--time-scale 1)",
    )
    parser.add_argument("--model", default=".kubellm/models/tiny", help="vllm: the checkpoint")
    parser.add_argument("--interactive-tokens", type=int, default=450, help="~4 chars each")
    parser.add_argument("--interactive-answer", type=int, default=100)
    parser.add_argument("--batch-tokens", type=int, default=1000, help="~4 chars each")
    parser.add_argument("--batch-answer", type=int, default=300)
    parser.add_argument("--fair-outstanding", type=int, default=32)
    parser.add_argument(
        "--fair-in-flight",
        type=int,
        default=None,
        help="fairness: requests per replica the gateway keeps in flight (default maxNumSeqs)",
    )
    parser.add_argument(
        "--fair-in-flight-tokens",
        type=float,
        default=9600.0,
        help="fair: --fair-in-flight-tokens (service tokens in flight per replica that "
        "contending tenants share)",
    )
    parser.add_argument(
        "--fair-weights", default="1,1,1", help="fairness: weights of small,medium,large"
    )
    parser.add_argument(
        "--fair-sizes", default="200,2000,8000", help="fairness: prompt tokens of each tenant"
    )
    parser.add_argument("--join-after", type=float, default=10.0, help="join: sim s")
    parser.add_argument("--join-seconds", type=float, default=30.0, help="join: sim s after")
    parser.add_argument("--join-window", type=float, default=5.0, help="join: share window")
    parser.add_argument("--headroom-load", type=float, default=12.0)
    parser.add_argument(
        "--headroom-prefill-rate",
        type=float,
        default=20000.0,
        help="tenants: low-band prompt tokens per simulated s per replica (--headroom-prefill-"
        "rate; a 1,000-token batch prompt every 50 ms, under the 8B/H100 profile's ~31,000 "
        "tokens/s of prefill)",
    )
    parser.add_argument("--band-ttl", type=float, default=60.0, help="simulated s")
    parser.add_argument("--ttft-slo", type=float, default=0.5, help="simulated s")
    parser.add_argument("--itl-slo", type=float, default=0.05, help="simulated s")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, sim s")
    parser.add_argument(
        "--order",
        default="shipped,off,tenants,before,today",
        help=f"contenders: {', '.join(CONTENDERS)} (shipped: the tenants file, no other flag)",
    )
    parser.add_argument("--quota-tpm", type=int, default=30000, help="tokens per minute")
    parser.add_argument("--quota-seconds", type=float, default=120.0, help="wall s")
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--out", default="bench/results/tenancy.json")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    scenarios = args.scenarios.split(",")
    out: dict[str, Any] = {"args": vars(args)}
    for seed in [int(x) for x in args.seeds.split(",")]:
        if "interference" in scenarios:
            rows = interference(args, seed)
            out.setdefault("interference", []).extend(rows)
            print(f"interference, seed {seed}: {args.replicas} {args.engine} replicas x "
                  f"maxNumSeqs {args.max_num_seqs}; interactive {args.rate:g}/s "
                  f"({args.interactive_tokens} -> {args.interactive_answer} tokens, streamed), "
                  f"batch {args.batch_outstanding} outstanding ({args.batch_tokens} -> "
                  f"{args.batch_answer}); {args.seconds:g} simulated s per phase")  # fmt: skip
            print(f"{'contender':9} {'p50 alone':>9} {'p99 alone':>9} {'p50 both':>9} "
                  f"{'p99 both':>9} {'p99 x':>6} {'refused i/b':>14} {'tok/s batch':>11} "
                  f"{'tok/s both':>10} {'both/batch':>10}")  # fmt: skip
            for r in rows:
                a, b, both = r["alone"], r["batch_alone"], r["both"]
                ratio = (both["ttft_p99"] / a["ttft_p99"]
                         if a["ttft_p99"] and both["ttft_p99"] else None)  # fmt: skip
                refused = (f"{both['interactive_refused']}/{both['interactive']} "
                           f"{both['batch_refused']}/{both['batch']}")  # fmt: skip
                work = both["output_tokens_per_s"] / b["output_tokens_per_s"] \
                    if b["output_tokens_per_s"] else None  # fmt: skip
                print(f"{r['contender']:9} {fmt(a['ttft_p50']):>9} {fmt(a['ttft_p99']):>9} "
                      f"{fmt(both['ttft_p50']):>9} {fmt(both['ttft_p99']):>9} "
                      f"{fmt(ratio, '.1f'):>6} {refused:>14} "
                      f"{fmt(b['output_tokens_per_s'], '.0f'):>11} "
                      f"{fmt(both['output_tokens_per_s'], '.0f'):>10} "
                      f"{fmt(work, '.0%'):>10}", flush=True)  # fmt: skip
            print("  where the interactive p99 was (sim s; gateway: the interactive tenant's "
                  "histograms, engines: every request's own TTFT), alone -> both:")  # fmt: skip
            for r in rows:
                a, both = r["alone"], r["both"]
                print(f"  {r['contender']:9} gateway TTFT {fmt(a['gateway_ttft_p99'])} -> "
                      f"{fmt(both['gateway_ttft_p99'])}, gateway wait "
                      f"{fmt(a['gateway_wait_p99'])} -> {fmt(both['gateway_wait_p99'])}, "
                      f"engine TTFT {fmt(a['engine_ttft_p99'])} -> "
                      f"{fmt(both['engine_ttft_p99'])}; refused with both (status and "
                      f"x-kubellm-drop-reason): {both['refusals']}", flush=True)  # fmt: skip
        if "fairness" in scenarios:
            rows = fairness(args, seed)
            out.setdefault("fairness", []).extend(rows)
            print(
                f"fairness, seed {seed}: 3 tenants x {args.fair_outstanding} outstanding "
                f"(weights {args.fair_weights}), {args.fair_sizes.replace(',', '/')}-token "
                f"prompts, 100-token answers (not streamed), {args.seconds:g} sim s; but "
                f"shipped: {args.fair_in_flight or args.max_num_seqs} in flight per replica at "
                f"most; fair: {args.fair_in_flight_tokens:g} tokens"
            )
            print(f"{'contender':9} {'small':>7} {'medium':>7} {'large':>7} {'jain':>6} "
                  f"{'refused':>7} {'service/s':>9} {'prompt/s':>8} {'output/s':>8}  "
                  f"mean wait at the gateway s (small/medium/large)")  # fmt: skip
            for r in rows:
                sh, w = r["shares"], r["waited"]
                waits = "/".join(fmt(w.get(t)) for t in ("small", "medium", "large"))
                print(
                    f"{r['contender']:9} {sh['small']:>7.1%} {sh['medium']:>7.1%} "
                    f"{sh['large']:>7.1%} {r['jain']:>6.3f} {r['refused']:>7} "
                    f"{r['service_per_s']:>9.0f} {r['prompt_per_s']:>8.0f} "
                    f"{r['output_per_s']:>8.0f}  {waits}  failed by status "
                    f"{r.get('statuses') or '-'}",
                    flush=True,
                )
        if "join" in scenarios:
            rows = joining(args, seed)
            out.setdefault("join", []).extend(rows)
            print(
                f"late joiner, seed {seed}: the 3 fairness tenants backlogged, a 4th "
                f"(2000-token prompts, {args.fair_outstanding} outstanding) joins at "
                f"{args.join_after:g} sim s; share per {args.join_window:g} s window"
            )
            print(f"{'contender':9} {'reached 90% of 1/4 after':>25} {'its share later':>15} "
                  f"{'refused':>7}")  # fmt: skip
            for r in rows:
                reached = "never" if r["reached_s"] is None else f"{r['reached_s']:.1f} s"
                later = f"{r['late_share_after']:.1%} (from {r['after_s']:g} s)"
                print(f"{r['contender']:9} {reached:>25} {later:>15} {r['refused']:>7}",
                      flush=True)  # fmt: skip
        if "quota" in scenarios:
            row = quota(args, seed)
            out.setdefault("quota", []).append(row)
            lo, al = row["loaded"], row["alone"]
            print(
                f"quota, seed {seed}: tokensPerMinute {row['tpm']}, offered 3x through two "
                f"gateways sharing Redis, {args.quota_seconds:g} wall s"
            )
            print(
                f"served/min {lo['served_per_minute']:.0f} = "
                f"{lo['served_per_minute'] / row['tpm']:.1%} of the quota "
                f"({lo['refused_429']}/{lo['metered']} refused 429); the other tenant's TTFT "
                f"p50/p99 {fmt(al['other_p50'])}/{fmt(al['other_p99'])} s alone, "
                f"{fmt(lo['other_p50'])}/{fmt(lo['other_p99'])} s beside it",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
