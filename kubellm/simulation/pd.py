"""A role-aware fleet simulation for prefill/decode disaggregation (issue 41): aggregated,
always-split, conditional (kubellm's `routing/disagg.decide`, the real function) and Dynamo's
published rule, on the same GPUs, on a simulated clock.

Each replica is the simulated engine's step physics (`engine_image/sim_profiles.py`: a step
costs base + prefill_token_s x prompt tokens + decode_token_s x decoding sequences, at most
max_num_batched_tokens prompt tokens a step, chunked, at most max_num_seqs running, a KV pool
of num_blocks x block_size tokens). A split request's prompt runs on a prefill replica (one
token), its KV moves to the decode replica after bytes / link bandwidth, and it decodes there
without computing the prompt. Decode routing: prefix holder first unless 1.25x past the least
load, else least load (the shipped prefix-aware rule's shape). The conditional decision calls
`disagg.decide` with the margin of `PrefillSplit` and predictions from the replicas' state,
each replica's multiplied per request by a seeded lognormal factor (`error`: the sigma of its
log; 0: exact state) while the engines run the true costs, so the margin is measured against
the latency model's error (`ERRORS`). `bench/simulation/pd_disagg.py` and `kubellm plan
--trace --pd` run it.

Goodput as DistServe defines it: the highest rate at which >= 90% of requests meet both the
TTFT and the mean-ITL target (`goodput`: bisection over a rate).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kubellm import capacity
from kubellm.engine.sim_profiles import PROFILES, Profile
from kubellm.gateway.discovery.base import PrefillSplit
from kubellm.gateway.routing.disagg import Inputs, Verdict, decide
from kubellm.gateway.routing.latency.model import (
    PREFILL_RATE_WINDOW_S,
    Dispatch,
    Prior,
    ReplicaModel,
)
from kubellm.gateway.routing.latency.predictions import ANSWER_RATE, PRIOR_ANSWER_LENGTH

LINK = capacity.KV_LINK_GBPS["rdma"] * 1e9
ATTAIN = 0.9  # DistServe's goodput: the rate at which 90% meet both SLOs
SHAPES = ("aggregated", "always", "conditional", "dynamo")
DYNAMO_MAX_LOCAL = 2048  # Dynamo's conditional disaggregation, as issue 41 states it
DYNAMO_RATIO = 0.7
DYNAMO_QUEUE = 2  # prefill busy: more than this many prompts queued on every prefill replica
# The predictions' error: the sigma of the log of the factor each replica's predictions for a
# request are multiplied by. Realistic 0.3 is a mean absolute error of 25%, the slo-aware
# latency model's TTFT MAPE near the knee (17-28% on the simulated pools, 23-29% on real
# engines: docs/operations.md, "SLO-aware routing", bench/gateway/slo_routing.py);
# pessimistic 0.6 is 54%, the model's worst measured (55-59% on mixed-speed pools).
ERRORS = {"exact": 0.0, "realistic": 0.3, "pessimistic": 0.6}


@dataclass(frozen=True)
class Pool:
    """`replicas` replicas of `gpus` GPUs each, on a simulator profile; the model's KV bytes
    per token and the KV link between the roles."""

    profile: str
    gpus: int
    replicas: int
    kv_bytes: int
    link_bytes_per_s: float = LINK


@dataclass(frozen=True)
class Req:
    t: float
    prompt: int
    output: int
    prefix: int = -1  # a shared prefix's id (-1: none)
    shared: int = 0  # its tokens


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
        self,
        pool: Pool,
        shape: str,
        prefill: int,
        reqs: list[Req],
        slo: tuple[float, float],
        margin: float = PrefillSplit.margin,
        error: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.gpus, replicas, self.kv_bytes, self.link = (
            pool.gpus,
            pool.replicas,
            pool.kv_bytes,
            pool.link_bytes_per_s,
        )
        self.p = p = PROFILES[pool.profile]
        self.model = ReplicaModel(
            Prior(p.step_base_s, p.prefill_token_s, p.decode_token_s, p.max_num_batched_tokens)
        )  # the gateway's latency model, at the profile's exact figures
        self.shape, self.slo, self.reqs = shape, slo, reqs
        self.margin, self.error = margin, error
        self.rng = random.Random(f"prediction-error/{seed}")
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
        # with `record`, each conditional decision: the request's index, what `decide` read
        # and said, and the jobs decoding on its decode replica then (`pd_disagg --harm`)
        self.record = False
        self.answer_tokens = PRIOR_ANSWER_LENGTH  # the answers' mean length, as the gateway's
        self.verdicts: list[tuple[int, Inputs, Verdict, tuple[int, ...]]] = []

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

    def factors(self) -> list[float]:
        """Each replica's prediction error for one request: a factor on every prediction
        for it there (1: exact state), drawn once per request whatever the decision."""
        if not self.error:
            return [1.0] * len(self.replicas)
        return [self.rng.lognormvariate(0.0, self.error) for _ in self.replicas]

    def split(self, d: int, req: Req, index: int = -1) -> tuple[bool, int]:
        if not self.prefillers:
            return False, -1
        u = self.uncached(d, req)
        f = self.factors()
        prefill_ttft = {i: f[i] * self.ttft(i, self.uncached(i, req)) for i in self.prefillers}
        best = min(self.prefillers, key=prefill_ttft.__getitem__)
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
        inputs = Inputs(
            prompt_tokens=req.prompt, uncached_tokens=u, local_ttft=f[d] * self.ttft(d, u),
            decode_step_s=f[d] * (p.step_base_s + p.decode_token_s * (len(r.running) + 1)),
            others_itl=f[d] * self.model.others_itl(Dispatch(
                req.prompt, req.prompt - u, prefill_rate=r.prompt_rate(self.now),
                in_flight=len(r.running), running=len(r.running),
            )),
            prefill_token_s=p.prefill_token_s,
            step_tokens=p.max_num_batched_tokens,
            prefill_ttft=prefill_ttft[best], answer_tokens=self.answer_tokens,
            kv_bytes_per_token=self.kv_bytes, link_bytes_per_s=self.link,
            ttft_target=self.slo[0], itl_target=self.slo[1], margin=self.margin,
            streams=len(r.running), prefill_queued=len(self.replicas[best].waiting),
        )  # fmt: skip
        verdict = decide(inputs)
        self.decision_s.append(time.perf_counter() - started)
        self.count(verdict.reason)
        if self.record:
            self.verdicts.append((index, inputs, verdict, tuple(j.index for j in r.running)))
        return verdict.split, best

    def count(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def arrive(self, index: int, now: float) -> None:
        req = self.reqs[index]
        d = self.pick_decode(req)
        split, pre = self.split(d, req, index)
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
            self.answered(job)
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
                transfer = self.kv_bytes * job.req.prompt / self.link
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
                self.answered(job)
                r.kv -= job.req.prompt + job.req.output
        self.kick(i, now)

    def answered(self, job: Job) -> None:
        """Learn the answers' mean length as the gateway's `Predictions` does."""
        self.answer_tokens += ANSWER_RATE * (job.req.output - self.answer_tokens)


def attained(jobs: list[Job], slo: tuple[float, float]) -> float:
    ok = 0
    for j in jobs:
        ttft = j.first - j.req.t
        itl = (j.last - j.first) / max(j.req.output - 1, 1)
        ok += ttft <= slo[0] and itl <= slo[1] and j.left <= 0
    return ok / len(jobs)


Sample = Callable[[float], Sequence[Req]]  # a workload sample's requests at a rate


def goodput(
    requests_at: Sample | Mapping[int, Sample],
    pool: Pool,
    shape: str,
    prefill: int,
    slo: tuple[float, float],
    hi: float,
    bisections: int = 6,
    attain: float = ATTAIN,
    margin: float = PrefillSplit.margin,
    error: float = 0.0,
) -> float:
    """The highest rate in [0, hi] whose requests (`requests_at(rate)`) meet both SLOs at
    least `attain` of the time (bisection; `margin` and `error` as `Sim`'s). Pooled: a
    mapping of seeds to samples, each run apart (its predictions' error drawn with its seed)
    and the share within both SLOs counted over all samples' requests together, so each
    point of the bisection weighs len(samples) times the requests of one."""
    samples = requests_at if isinstance(requests_at, Mapping) else {0: requests_at}

    def ok(rate: float) -> bool:
        jobs: list[Job] = []
        for seed, at in samples.items():
            sim = Sim(pool, shape, prefill, list(at(rate)), slo, margin, error, seed)
            jobs += sim.run()
        return attained(jobs, slo) >= attain

    if ok(hi):
        return hi
    lo = 0.0
    for _ in range(bisections):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def bound(pool: Pool, reqs: Sequence[Req]) -> float:
    """The fleet's compute bound (req/s), any shape: every GPU busy on the requests' prompt
    tokens and their sequences' KV reads, the step's fixed part shared by an unbounded batch
    (no SLO). No shape on these GPUs serves more."""
    p = PROFILES[pool.profile]
    prompt = statistics.mean(r.prompt for r in reqs)
    out = statistics.mean(r.output for r in reqs)
    return pool.replicas / (p.prefill_token_s * prompt + p.decode_token_s * out)


# ---------------------------------------------------------------- planning P:D for a trace

# Conditional split must serve at least this much more than aggregated serving on the same
# GPUs for P/D to pay: below it, the second role's operations and the KV link buy nothing a
# re-run would not lose to noise (a bisection's last step is 1.6% of the range).
PAYS = 1.05
MAX_TRACE_REQUESTS = 2000  # of the trace, from its start
MIN_SECONDS = 40.0  # of arrivals per run at least (the trace repeated), as the P/D bench
MAX_REQUESTS = 6000  # per run at most


def sweep(replicas: int, most: int = 7) -> list[int]:
    """The prefill replica counts to try on `replicas` replicas: 1 to replicas - 1, at most
    `most` of them, evenly spread."""
    if replicas < 2:
        return []
    counts = range(1, replicas)
    if len(counts) <= most:
        return list(counts)
    return sorted({round(1 + i * (replicas - 2) / (most - 1)) for i in range(most)})


def verdict(aggregated: float, split: dict[int, float]) -> tuple[bool, int | None]:
    """Whether P/D pays, and the prefill replicas to run: the conditional split's best
    goodput (fewest prefill replicas among equals) against PAYS x aggregated's."""
    if not split:
        return False, None
    best = max(split, key=lambda k: (split[k], -k))
    return split[best] >= PAYS * aggregated and split[best] > 0, best


def plan_trace(
    reqs: Sequence[Req], pool: Pool, slo: tuple[float, float], bisections: int = 6
) -> dict[str, object]:
    """P/D for a recorded trace on `pool`: the highest multiple of the trace's rate (its
    arrival pattern kept, times compressed) that aggregated serving and the conditional
    split at each P:D serve with 90% of requests within both SLOs, and the verdict."""
    reqs = list(reqs[:MAX_TRACE_REQUESTS])
    span = max(reqs[-1].t - reqs[0].t, 1e-9) if len(reqs) > 1 else 1.0
    rate = len(reqs) / span
    start = reqs[0].t
    ceiling = bound(pool, reqs) / rate

    def at(factor: float) -> list[Req]:
        # the trace at `factor` x its rate, repeated end to end until MIN_SECONDS of arrivals
        # (a short run at a high rate ends before the queues it builds show)
        period = (span + 1 / rate) / factor
        out: list[Req] = []
        while not out or (out[-1].t < MIN_SECONDS and len(out) < MAX_REQUESTS):
            shift = len(out) // len(reqs) * period
            out += [Req((r.t - start) / factor + shift, r.prompt, r.output, r.prefix, r.shared)
                    for r in reqs]  # fmt: skip
        return out[:MAX_REQUESTS]

    aggregated = goodput(at, pool, "aggregated", 0, slo, ceiling, bisections)
    split = {k: goodput(at, pool, "conditional", k, slo, ceiling, bisections)
             for k in sweep(pool.replicas)}  # fmt: skip
    pays, best = verdict(aggregated, split)
    return {
        "profile": pool.profile, "replicas": pool.replicas, "gpus_per_replica": pool.gpus,
        "link_gbps": pool.link_bytes_per_s / 1e9, "requests": len(reqs),
        "rate_rps": round(rate, 3), "bound_x": round(ceiling, 3),
        "aggregated_x": round(aggregated, 3),
        "conditional_x": {str(k): round(v, 3) for k, v in split.items()},
        "pays": pays, "prefill": best if pays else 0,
        "decode": pool.replicas - best if pays and best else pool.replicas,
    }  # fmt: skip


def plan_lines(pd: dict[str, object]) -> list[str]:
    """`plan_trace`'s answer in words."""
    split = pd["conditional_x"]
    assert isinstance(split, dict)
    tried = ", ".join(f"{k}:{pd['replicas'] - int(k)} {v:g}x" for k, v in split.items())  # type: ignore[operator]
    lines = [
        f"P/D on {pd['replicas']} replicas of {pd['profile']} x {pd['gpus_per_replica']} GPU "
        f"(KV link {pd['link_gbps']:g} GB/s; the first {pd['requests']} requests, "
        f"{pd['rate_rps']:g} req/s): the highest multiple of the trace's rate with 90% within "
        f"both SLOs: aggregated {pd['aggregated_x']:g}x; conditional split (P:D) {tried}; "
        f"compute bound {pd['bound_x']:g}x",
    ]
    if pd["pays"]:
        lines.append(
            f"P/D pays on this trace: run {pd['prefill']} prefill + {pd['decode']} decode "
            f"replicas (spec.prefill.replicas {pd['prefill']}, spec.replicas {pd['decode']})"
        )
    else:
        lines.append(
            f"P/D does not pay on this trace: no P:D serves {PAYS:g}x what aggregated serving "
            "does on the same GPUs; keep it aggregated"
        )
    return lines
