"""P/D disaggregation on the same GPUs: aggregated, always-split, conditional (kubellm's
`routing/disagg.decide`) and Dynamo's published rule (issue 41, Measure).

One run, simulated clock, no sleep: each replica is the simulated engine's step physics
(`engine_image/sim_profiles.py`: a step costs base + prefill_token_s x prompt tokens +
decode_token_s x decoding sequences, at most max_num_batched_tokens prompt tokens a step,
chunked, at most max_num_seqs running, a KV pool of num_blocks x block_size tokens). A
split request's prompt runs on a prefill replica (one token), its KV moves to the decode
replica after bytes / link bandwidth (capacity.KV_LINK_GBPS, RDMA), and it decodes there
without computing the prompt. Decode routing: prefix holder first unless 1.25x past the
least load, else least load (the shipped prefix-aware rule's shape). The conditional
decision calls the real `disagg.decide` with the replicas' exact state (the bench measures
the rule, not the latency model's error: tests/gateway/routing/test_disagg.py covers
`plan`). Gamma arrivals (burstiness 0.5: shape 0.5, CV sqrt 2).

Goodput as DistServe defines it: the highest rate at which >= 90% of requests meet both
the TTFT and the mean-ITL target (bisection over the rate). Run:
`.venv/bin/python bench/pd_disagg.py [--quick]`.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kubellm.engine.sim_profiles import PROFILES, Profile
from kubellm.gateway.routing.disagg import Inputs, decide
from kubellm.gateway.routing.latency.model import (
    PREFILL_RATE_WINDOW_S,
    Dispatch,
    Prior,
    ReplicaModel,
)

from kubellm import capacity

LINK = capacity.KV_LINK_GBPS["rdma"] * 1e9
ATTAIN = 0.9  # DistServe's goodput: the rate at which 90% meet both SLOs
BURSTINESS = 0.5  # gamma shape (1: Poisson)
POOLS = {  # name: (profile, GPUs per replica, replicas of the same GPU count, KV bytes/token)
    "8B/H100": ("llama-3.1-8b-h100", 1, 8, capacity.kv_bytes_per_token(32, 8, 128, 2)),
    "70B/4xH100": ("llama-3.1-70b-4xh100", 4, 4, capacity.kv_bytes_per_token(80, 8, 128, 2)),
}
SECONDS = 40.0  # of arrivals at least, per point
MAX_REQUESTS = 6000
DYNAMO_MAX_LOCAL = 2048  # Dynamo's conditional disaggregation, as the issue states it
DYNAMO_RATIO = 0.7
DYNAMO_QUEUE = 2  # prefill busy: more than this many prompts queued on every prefill replica


# ---------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Req:
    t: float
    prompt: int
    output: int
    prefix: int = -1  # a shared prefix's id (-1: none)
    shared: int = 0  # its tokens


def lognormal(rng: random.Random, median: float, low: int, high: int, sigma: float = 0.6) -> int:
    return int(min(high, max(low, rng.lognormvariate(math.log(median), sigma))))


def workload(name: str, rate: float, count: int, seed: int = 0) -> list[Req]:
    """Long-prompt RAG/agent (4-16k prompts, 100-500 answers, a third on 8 shared 4k
    prefixes), production chat (Azure 2023 conversation lengths: median prompt 1,020 and
    answer 129 tokens, Splitwise, Patel et al. 2024), or a half-half mix; gamma arrivals."""
    rng = random.Random(f"{name}/{seed}")
    out, t = [], 0.0
    for _ in range(count):
        t += rng.gammavariate(BURSTINESS, 1.0 / (rate * BURSTINESS))
        kind = name if name != "mix" else rng.choice(("rag", "chat"))
        if kind == "rag":
            prompt, output = rng.randint(4096, 16384), rng.randint(100, 500)
            if rng.random() < 1 / 3:
                out.append(Req(t, prompt, output, rng.randrange(8), 4096))
                continue
            out.append(Req(t, prompt, output))
        else:
            out.append(Req(t, lognormal(rng, 1020, 16, 8000), lognormal(rng, 129, 4, 1024)))
    return out


# ---------------------------------------------------------------- replicas


@dataclass
class Job:
    req: Req
    index: int
    todo: int  # prompt tokens still to compute here
    left: int  # tokens still to emit
    first: float = -1.0
    last: float = -1.0
    split: bool = False
    decode_at: int = -1  # the decode replica of a split job
    admitted_at: int = -1  # the replica holding its KV


@dataclass
class Replica:
    role: str  # agg | prefill | decode
    p: Profile
    waiting: deque[Job] = field(default_factory=deque)
    running: list[Job] = field(default_factory=list)
    kv: int = 0  # tokens held
    prefixes: dict[int, None] = field(default_factory=dict)  # LRU of shared prefixes held
    busy: bool = False
    queued_tokens: int = 0
    rate: tuple[float, float] = (0.0, 0.0)  # prompt tokens/s sent here lately, as of when

    def prompt_rate(self, now: float, add: int = 0) -> float:
        """As the gateway's `Predictions.prefill_rate`: decayed over the window."""
        rate, then = self.rate
        window = PREFILL_RATE_WINDOW_S
        rate = rate * math.exp(-(now - then) / window) + add / window
        if add:
            self.rate = (rate, now)
        return rate

    @property
    def capacity(self) -> int:
        return self.p.num_blocks * self.p.block_size

    def load(self) -> float:
        return len(self.running) + len(self.waiting) + self.queued_tokens / 2048


class Sim:
    def __init__(
        self, pool: str, shape: str, prefill: int, reqs: list[Req], slo: tuple[float, float]
    ):
        name, self.gpus, replicas, self.kv_bytes = POOLS[pool]
        self.p = p = PROFILES[name]
        self.model = ReplicaModel(
            Prior(p.step_base_s, p.prefill_token_s, p.decode_token_s, p.max_num_batched_tokens)
        )  # the gateway's latency model, at the profile's exact figures
        self.shape, self.slo, self.reqs = shape, slo, reqs
        self.now = 0.0
        roles = ["agg"] * replicas if shape == "aggregated" else (
            ["prefill"] * prefill + ["decode"] * (replicas - prefill))  # fmt: skip
        self.replicas = [Replica(r, self.p) for r in roles]
        self.decoders = [i for i, r in enumerate(self.replicas) if r.role != "prefill"]
        self.prefillers = [i for i, r in enumerate(self.replicas) if r.role == "prefill"]
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, kind, arg)
        self.seq = 0
        self.jobs: list[Job] = []
        self.reasons: dict[str, int] = {}
        self.gaps: list[float] = []  # every decode gap of every stream
        self.harmed: list[float] = []  # gaps of streams already decoding, in steps that
        # computed >= 2k prompt tokens: the long prompts' harm to them
        self.decision_s: list[float] = []
        self.current: dict[int, tuple[list[tuple[Job, int]], int, int]] = {}

    def push(self, at: float, kind: int, arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, arg))

    def run(self) -> list[Job]:
        for i, r in enumerate(self.reqs):
            self.push(r.t, 0, i)
        while self.events:
            now, _, kind, arg = heapq.heappop(self.events)
            self.now = now
            if kind == 0:
                self.arrive(arg, now)
            elif kind == 1:
                self.step_end(arg, now)
            else:  # KV arrived at the decode replica
                job = self.jobs[arg]
                r = self.replicas[job.decode_at]
                r.waiting.append(job)
                self.kick(job.decode_at, now)
        return self.jobs

    # routing -------------------------------------------------------------

    def pick_decode(self, req: Req) -> int:
        least = min(self.decoders, key=lambda i: self.replicas[i].load())
        if req.prefix >= 0:
            holders = [i for i in self.decoders if req.prefix in self.replicas[i].prefixes]
            if holders:
                best = min(holders, key=lambda i: self.replicas[i].load())
                if self.replicas[best].load() <= 1.25 * self.replicas[least].load() + 1:
                    return best
        return least

    def uncached(self, i: int, req: Req) -> int:
        held = req.prefix >= 0 and req.prefix in self.replicas[i].prefixes
        return req.prompt - (req.shared if held else 0)

    def ttft(self, i: int, tokens: int) -> float:
        """Prefill time on replica i: the prompts queued there, then this one, in steps."""
        r, p = self.replicas[i], self.p
        ahead = r.queued_tokens + tokens
        step = p.step_base_s + p.decode_token_s * len(r.running)
        return (1 + ahead // p.max_num_batched_tokens + 0.5) * step + p.prefill_token_s * ahead

    def split(self, d: int, req: Req) -> tuple[bool, int]:
        if not self.prefillers:
            return False, -1
        u = self.uncached(d, req)
        best = min(self.prefillers, key=lambda i: self.ttft(i, self.uncached(i, req)))
        if self.shape == "always":
            self.count("always")
            return True, best
        if self.shape == "dynamo":
            busy = all(len(self.replicas[i].waiting) > DYNAMO_QUEUE for i in self.prefillers)
            remote = u >= DYNAMO_MAX_LOCAL and u >= DYNAMO_RATIO * req.prompt and not busy
            self.count("dynamo-remote" if remote else "dynamo-busy" if busy else "dynamo-local")
            return remote, best
        r, p = self.replicas[d], self.p
        started = time.perf_counter()
        verdict = decide(Inputs(
            prompt_tokens=req.prompt, uncached_tokens=u, local_ttft=self.ttft(d, u),
            decode_step_s=p.step_base_s + p.decode_token_s * (len(r.running) + 1),
            others_itl=self.model.others_itl(Dispatch(
                req.prompt, req.prompt - u, prefill_rate=r.prompt_rate(self.now),
                in_flight=len(r.running), running=len(r.running),
            )),
            prefill_token_s=p.prefill_token_s,
            step_tokens=p.max_num_batched_tokens,
            prefill_ttft=self.ttft(best, self.uncached(best, req)),
            kv_bytes_per_token=self.kv_bytes, link_bytes_per_s=LINK,
            ttft_target=self.slo[0], itl_target=self.slo[1],
        ))  # fmt: skip
        self.decision_s.append(time.perf_counter() - started)
        self.count(verdict.reason)
        return verdict.split, best

    def count(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def arrive(self, index: int, now: float) -> None:
        req = self.reqs[index]
        d = self.pick_decode(req)
        split, pre = self.split(d, req)
        job = Job(req, index, 0, req.output, split=split, decode_at=d)
        self.jobs.append(job)
        at = pre if split else d
        job.todo = self.uncached(at, req)
        r = self.replicas[at]
        if req.prefix >= 0:
            r.prefixes.pop(req.prefix, None)
            r.prefixes[req.prefix] = None
            if len(r.prefixes) > 4:
                r.prefixes.pop(next(iter(r.prefixes)))
        r.waiting.append(job)
        r.queued_tokens += job.todo
        r.prompt_rate(now, job.todo)
        self.kick(at, now)

    # engine steps ----------------------------------------------------------

    def kick(self, i: int, now: float) -> None:
        r = self.replicas[i]
        if not r.busy and (r.waiting or r.running):
            self.step_start(i, now)

    def step_start(self, i: int, now: float) -> None:
        r, p = self.replicas[i], self.p
        budget = p.max_num_batched_tokens - len(r.running)
        decodes = len(r.running)
        chunks: list[tuple[Job, int]] = []
        for job in r.waiting:
            if budget <= 0 or len(r.running) + len(chunks) >= p.max_num_seqs:
                break
            if job.admitted_at != i:  # a new sequence: room for its KV, or it waits (as vLLM)
                need = job.req.prompt + (job.req.output if r.role != "prefill" else 0)
                if r.kv + need > r.capacity:
                    break
                r.kv += need
                job.admitted_at = i
            take = min(job.todo, budget)
            chunks.append((job, take))
            budget -= take
        prefill = sum(t for _, t in chunks)
        self.current[i] = (chunks, decodes, prefill)
        r.busy = True
        self.push(now + p.step_seconds(prefill, decodes), 1, i)

    def step_end(self, i: int, now: float) -> None:
        r = self.replicas[i]
        chunks, _, prefill = self.current[i]
        r.busy = False
        done = []
        for job in r.running:
            gap = now - job.last
            self.gaps.append(gap)
            if prefill >= 2048:
                self.harmed.append(gap)
            job.last = now
            job.left -= 1
            if job.left <= 0:
                done.append(job)
        for job in done:
            r.running.remove(job)
            r.kv -= job.req.prompt + job.req.output
        for job, take in chunks:
            job.todo -= take
            r.queued_tokens -= take
            if job.todo > 0:
                continue
            r.waiting.remove(job)
            if r.role == "prefill":  # first token here; the KV goes to the decode replica
                job.first = job.last = now
                job.left -= 1
                r.kv -= job.req.prompt
                transfer = self.kv_bytes * job.req.prompt / LINK
                self.push(now + transfer, 2, job.index)
                continue
            if job.first < 0:
                job.first = job.last = now
                job.left -= 1
            if job.left > 0:
                if job.split:  # its KV arrived: its gaps from here are this replica's steps
                    job.last = now
                r.running.append(job)
            else:
                r.kv -= job.req.prompt + job.req.output
        self.kick(i, now)


# ---------------------------------------------------------------- measures


def attained(jobs: list[Job], slo: tuple[float, float]) -> float:
    ok = 0
    for j in jobs:
        ttft = j.first - j.req.t
        itl = (j.last - j.first) / max(j.req.output - 1, 1)
        ok += ttft <= slo[0] and itl <= slo[1] and j.left <= 0
    return ok / len(jobs)


def run(pool: str, shape: str, prefill: int, wl: str, rate: float, n: int, slo) -> Sim:
    """`n` requests, or `SECONDS` of arrivals at `rate` where that is more (a short run at
    a high rate ends before the queues it builds show: 500 chat requests at 150/s are 3 s)."""
    count = min(MAX_REQUESTS, max(n, int(rate * SECONDS)))
    sim = Sim(pool, shape, prefill, workload(wl, rate, count), slo)
    sim.run()
    return sim


def goodput(pool: str, shape: str, prefill: int, wl: str, n: int, slo, hi: float) -> float:
    """The highest rate (req/s) with >= 90% of requests within both SLOs (bisection)."""
    lo = 0.0
    if attained(run(pool, shape, prefill, wl, hi, n, slo).jobs, slo) >= ATTAIN:
        return hi
    for _ in range(6):
        mid = (lo + hi) / 2
        if attained(run(pool, shape, prefill, wl, mid, n, slo).jobs, slo) >= ATTAIN:
            lo = mid
        else:
            hi = mid
    return lo


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bound(pool: str, wl: str) -> float:
    """The fleet's compute bound (req/s), any shape: every GPU busy on the workload's prompt
    tokens and its sequences' KV reads, the step's fixed part shared by an unbounded batch
    (no SLO). No shape on these GPUs serves more."""
    name, _, replicas, _ = POOLS[pool]
    p = PROFILES[name]
    reqs = workload(wl, 1.0, 2000)
    prompt = statistics.mean(r.prompt for r in reqs)
    out = statistics.mean(r.output for r in reqs)
    return replicas / (p.prefill_token_s * prompt + p.decode_token_s * out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    args = ap.parse_args()
    n = 150 if args.quick else 300
    slos = {"rag": (2.0, 0.030), "chat": (2.0, 0.030), "mix": (2.0, 0.030)}
    print(f"# P/D on the same GPUs; {n} requests or {SECONDS:g} s of arrivals per point (the"
          f" more), gamma arrivals (shape {BURSTINESS}),"
          f" KV link {LINK / 1e9:g} GB/s (RDMA); SLO TTFT 2 s, mean ITL 30 ms; goodput = the"
          " highest rate with 90% within both")  # fmt: skip
    for pool, (name, gpus, replicas, _) in POOLS.items():
        print(f"\n## {pool}: {replicas} replicas x {gpus} GPU ({name})")
        for wl in ("rag", "chat", "mix"):
            slo = slos[wl]
            cap = bound(pool, wl)
            hi = cap
            rows = [("aggregated", 0)]
            for shape in ("always", "conditional", "dynamo"):
                ratios = (1, 2, 4) if replicas == 8 else (1, 2)
                best = max(ratios, key=lambda k, s=shape: goodput(
                    pool, s, k, wl, n, slo, hi))  # fmt: skip
                rows.append((shape, best))
            print(f"\n### {wl}: compute bound {cap:.1f} req/s (every GPU busy, no SLO)")
            print("| shape | P:D | goodput req/s | SLO-met req/s at 1.3x agg knee | TTFT p50 | "
                  "TTFT p99 | ITL p99 beside a >=2k-token prefill (else all) | split share |"
                  " reasons |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|")
            knee = None
            for shape, k in rows:
                g = goodput(pool, shape, k, wl, n, slo, hi)
                knee = knee or g
                sim = run(pool, shape, k, wl, max(knee * 1.3, 0.1), n, slo)
                met = attained(sim.jobs, slo) * max(knee * 1.3, 0.1)
                at = run(pool, shape, k, wl, max(g, 0.05), n, slo)
                ttfts = [j.first - j.req.t for j in at.jobs]
                split = sum(j.split for j in at.jobs) / len(at.jobs)
                reasons = ", ".join(f"{r} {c}" for r, c in sorted(at.reasons.items()))
                pd = "-" if shape == "aggregated" else f"{k}:{replicas - k}"
                print(f"| {shape} | {pd} | {g:.2f} | {met:.2f} | {pct(ttfts, .5):.2f} | "
                      f"{pct(ttfts, .99):.2f} | {1e3 * pct(at.harmed or at.gaps, .99):.0f} ms |"
                      f" {split:.0%} | {reasons} |")  # fmt: skip
    # the decision's cost at 16 prefill + 16 decode replicas (wall clock: load printed)
    sim = Sim("8B/H100", "conditional", 1, [], (2.0, 0.03))
    sim.replicas = [Replica("prefill", sim.p) for _ in range(16)] + [
        Replica("decode", sim.p) for _ in range(16)]  # fmt: skip
    sim.decoders, sim.prefillers = list(range(16, 32)), list(range(16))
    for i, req in enumerate(workload("mix", 1.0, 2000)):
        started = time.perf_counter()
        d = sim.pick_decode(req)
        sim.split(d, req)
        sim.decision_s[-1:] = [time.perf_counter() - started] if sim.decision_s else []
        sim.replicas[i % 32].queued_tokens = (i * 977) % 20000
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    print(f"\ndecision cost at 16 prefill + 16 decode replicas (pick decode + decide, wall "
          f"clock, load {load}): p50 {1e6 * pct(sim.decision_s, .5):.0f} us, p99 "
          f"{1e6 * pct(sim.decision_s, .99):.0f} us")  # fmt: skip


if __name__ == "__main__":
    main()
