"""Interference on a simulated clock (python -m bench.tenancy_sim --scenario interference): the
gateway's own admission pass (`dispatch.admit_once`) with its flow gate (`gates/flow.py`,
`flow/controller.py`, `flow/queues.py`), load view and router, in front of simulated
replicas (`sim_core`), no process and no wall clock.

An interactive tenant (priority 10) sends chats at a Poisson rate; a batch tenant
(priority -1) keeps N requests outstanding (a refused one comes back after Retry-After,
1 s); three more tenants at priority 0 are declared and idle (the issue's tenants file).
The loop is the scheduler's: a waiting request passes again on every change (a release, a
scrape, a wake) or after min(its deadline, 0.5 s, the gate's wake_in); scrapes every 1 s.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kubellm.engine import sim_core
from kubellm.gateway.discovery.base import Endpoint, ModelTarget
from kubellm.gateway.routing.admission import CompletionRate, Route
from kubellm.gateway.routing.dispatch import WAKE_IN, Pass, admit_once
from kubellm.gateway.routing.flow import tenants
from kubellm.gateway.routing.flow.controller import Caller, Tenancy, TenancySettings, bounded
from kubellm.gateway.routing.gates import flow as flow_gate
from kubellm.gateway.routing.gates.flow import FlowGate
from kubellm.gateway.routing.replicas.load import EngineStats, LoadView
from kubellm.gateway.routing.replicas.outliers import OutlierDetector
from kubellm.gateway.routing.router import Router, routing_request
from kubellm.gateway.routing.settings import FlowSettings, SchedulerSettings
from prometheus_client import CollectorRegistry

from kubellm.api import SLO, Routing
from kubellm.bench.stats import percentile

DOC = {
    "tenants": [
        {"name": "interactive", "priority": 10},
        {"name": "batch", "priority": -1},
        *({"name": n, "priority": 0} for n in ("a", "b", "c")),
    ]
}
RETRY_AFTER = SchedulerSettings().retry_after_seconds


@dataclass(frozen=True)
class Mix:
    rate: float = 8.0  # interactive requests per s (Poisson)
    chat: tuple[int, int] = (450, 100)  # its prompt and answer tokens
    stream: bool = True  # interactive streamed
    outstanding: int = 64  # batch requests outstanding
    batch: tuple[int, int] = (1000, 300)
    slow: int = 0  # replicas slowed 1.5x
    replicas: int = 4


# `issue`: bench/gateway/tenancy.py's interference phase (the tenants file, 4 x 8B/H100,
# maxNumSeqs 16); the rest were not tuned on: a batch backlog past the slots, twice the chat
# rate, chats not streamed, other prompt sizes, replicas that differ.
MIXES = {
    "issue": Mix(),
    "batch-256": Mix(outstanding=256),
    "chat-16/s": Mix(rate=16.0),
    "chat-not-streamed": Mix(stream=False),
    "mix-150-200/3000-100": Mix(chat=(150, 200), batch=(3000, 100)),
    "2fast2slow": Mix(slow=2),
}


def contender(name: str) -> FlowSettings:
    """`shipped`: the defaults (the prefill budget at each replica's learnt speed while the
    chats are about); `unpaced`: --headroom-prefill-rate off (the shipped line until
    2026-12-03); `prefill-N`: --headroom-prefill-rate N; `before`: the unpaced line as it
    was before the low band's ramp (no bound until the slots are learnt)."""
    if name == "shipped":
        return FlowSettings()
    if name in ("unpaced", "before"):
        return FlowSettings(headroom_prefill_learnt=False)
    if name.startswith("prefill-"):
        return FlowSettings(headroom_prefill_rate=float(name.removeprefix("prefill-")))
    raise SystemExit(f"--contenders: {name!r}: shipped, before or prefill-N")


@dataclass
class _Ticket:
    """What the flow gate's ticket hooks read of a `lifecycle.Ticket`."""

    caller: Caller
    target: ModelTarget
    stream: bool
    done: bool = False
    hold: str | None = None
    status: int = 0
    route: str = "none"
    good: bool = False
    ttft: float | None = None
    served: tuple[int, int] | None = None
    timing: Any = field(default_factory=lambda: type("T", (), {"gaps": ()})())

    def served_tokens(self) -> tuple[int, int] | None:
        return self.served


@dataclass(eq=False)
class _Req:
    tenant: str
    prompt: int
    answer: int
    stream: bool
    arrived: float
    p: Pass | None = None
    ticket: _Ticket | None = None
    look: int = 0  # the generation of its timed look-again
    admitted: float | None = None
    started: float | None = None  # first scheduled in an engine step
    first: float | None = None
    batch_ahead: int = 0  # batch requests on its replica when it was sent
    release: Any = None
    url: str = ""
    end: float = 0.0


def _finish(coro: Any) -> Any:
    """Run a coroutine that never suspends (`Tenancy.admit` without quotas) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("suspended")


def run(
    mix: Mix,
    flow: FlowSettings,
    interactive: bool,
    batch: bool,
    seconds: float,
    warm: float,
    seed: int = 1,
    profile: Any = None,
) -> dict[str, Any]:
    rng = random.Random(seed)
    now = 0.0
    clock = lambda: now  # noqa: E731
    load = LoadView(clock=clock)
    router = Router(load, OutlierDetector(), random.Random(seed))
    urls = [f"http://r{i}" for i in range(mix.replicas)]
    target = ModelTarget(
        "m", "m", endpoints=tuple(Endpoint(u) for u in urls), routing=Routing(policy="least-load"),
        slo=SLO(),  # the default TTFT target (2 s): a high band's wait budget
    )  # fmt: skip
    settings = SchedulerSettings()
    tenancy = Tenancy(
        bounded(TenancySettings(tenants.parse(DOC), flow), settings.max_queue), CollectorRegistry()
    )
    changed = [False]

    def wake() -> None:
        changed[0] = True

    load.on_release(wake)
    gate = FlowGate(tenancy, wake, load.prefill_rate)
    flow_gate.time = SimpleNamespace(monotonic=clock)  # type: ignore[attr-defined]  # its debts
    gates = (gate,)
    completions = CompletionRate(clock=clock)
    profiles = [profile] * (mix.replicas - mix.slow) + [profile.slowed(1.5)] * mix.slow
    engines = [sim_core.Engine(p) for p in profiles]
    busy = [False] * len(engines)
    # vLLM's vllm:prompt_tokens_total (counted at a first token) and the sum of
    # vllm:request_prefill_time_seconds (observed at the end), per replica
    prefilled = [[0.0, 0.0] for _ in engines]
    live: dict[str, _Req] = {}
    waiting: list[_Req] = []
    events: list[tuple[float, int, str, Any]] = []
    seq = [0]
    done: list[_Req] = []
    refused: list[tuple[_Req, str]] = []

    def push(t: float, kind: str, payload: Any = None) -> None:
        seq[0] += 1
        heapq.heappush(events, (t, seq[0], kind, payload))

    def arrive(tenant: str) -> None:
        prompt, answer = mix.chat if tenant == "interactive" else mix.batch
        stream = mix.stream if tenant == "interactive" else False
        r = _Req(tenant, prompt, answer, stream, now)
        t = tenancy.tenants.get(tenant)
        caller = Caller(t, t.priority, tenant)
        body = {"messages": [{"content": "x" * (4 * prompt)}], "max_tokens": answer}
        _finish(tenancy.admit(caller, body))
        r.ticket = _Ticket(caller, target, stream)
        routing = routing_request("m", body, None)
        candidates = router.candidates(target)
        r.p = Pass(target, routing, now, now + target.slo.ttft_seconds, bool(candidates),
                   settings.thresholds, caller, completions.rate)  # fmt: skip
        gate.enter(r.p)
        waiting.append(r)
        look(r, first=True)

    def look(r: _Req, first: bool = False) -> bool:
        """One pass for `r`; True when it left the queue."""
        p = r.p
        assert p is not None
        position = len(waiting) if first else waiting.index(r) + 1
        p.refresh(target, router.candidates(target), now, None, 0, position, True)
        decision = admit_once(p, gates, router)
        if decision is None:
            r.look += 1
            push(now + max(min(p.deadline - now, WAKE_IN, p.wake_in), 0.001), "look", (r, r.look))
            return False
        waiting.remove(r)
        gate.leave(p)
        ticket = r.ticket
        assert ticket is not None
        if decision.route is not Route.REPLICA:
            ticket.status, ticket.done = 429, True
            refused.append((r, decision.reason))
            gate.ended(ticket)
            if r.tenant == "batch":
                push(now + RETRY_AFTER, "batch")
            return True
        r.admitted = now
        url = r.url = decision.order[0].url
        i = urls.index(url)
        ticket.route = "replica"
        gate.sent(ticket, url)
        r.release = load.acquire(url)
        e = engines[i]
        r.batch_ahead = sum(live[q.request_id].tenant == "batch" for q in
                            (*e.running, *e.waiting))  # fmt: skip
        rid = f"q{seq[0]}"
        seq[0] += 1
        tokens = [rng.randrange(1, 50_000) for _ in range(r.prompt)]
        live[rid] = r
        e.add(sim_core.Request(rid, tokens, r.answer, arrival=now))
        if not busy[i]:
            busy[i] = True
            push(now, "step", i)
        return True

    def pump() -> None:
        rounds = 0
        while changed[0] and rounds < 50:
            changed[0] = False
            rounds += 1
            for r in list(waiting):
                if r in waiting:
                    look(r)

    for k in range(int(seconds) + 1):
        push(k + 0.5, "scrape")
    if batch:
        for _ in range(mix.outstanding):
            push(0.0, "batch")
    if interactive:
        push(rng.expovariate(mix.rate), "chat")
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if now > seconds:
            break
        if kind == "chat":
            arrive("interactive")
            push(now + rng.expovariate(mix.rate), "chat")
        elif kind == "batch":
            arrive("batch")
        elif kind == "look":
            r, gen = payload
            if r in waiting and r.look == gen:
                look(r)
        elif kind == "scrape":
            for url, e, (tokens, secs) in zip(urls, engines, prefilled, strict=True):
                load.record(url, EngineStats(float(len(e.waiting)), float(len(e.running)),
                                             e.kv_cache_usage(), now,
                                             prefill=(tokens, secs)))  # fmt: skip
        elif kind == "step":
            i = payload
            step = engines[i].step()
            for q in engines[i].running:
                r = live.get(q.request_id)
                if r is not None and r.started is None and q.computed > 0:
                    r.started = now
            push(now + step.duration, "done", (i, step))
        else:  # a step ended
            i, step = payload
            for q, _ in step.tokens:
                r = live[q.request_id]
                if r.started is None:
                    r.started = now - step.duration
                if r.first is None:
                    r.first = now
                    # the prompt tokens it computed, as the gateway reads them from vLLM
                    # (prompt_tokens_by_source{source="local_compute"}: cache hits not in it)
                    prefilled[i][0] += max(r.prompt - q.cached_tokens, 1)
                    if r.stream:
                        assert r.ticket is not None
                        r.ticket.ttft = now - r.arrived
                        gate.first_token(r.ticket, now)
            for q in step.finished:
                r = live.pop(q.request_id)
                prefilled[i][1] += r.first - r.started  # type: ignore[operator]
                ticket = r.ticket
                assert ticket is not None
                ticket.status, ticket.done = 200, True
                ticket.served = (r.prompt, len(q.output))
                if not r.stream:
                    ticket.ttft = now - r.arrived
                r.first = r.first if r.stream else now
                r.release()
                completions.record(r.url)
                gate.over(ticket)
                gate.ended(ticket)
                r.end = now
                done.append(r)
                if r.tenant == "batch":
                    push(now, "batch")
            if engines[i].has_work:
                push(now, "step", i)
            else:
                busy[i] = False
        pump()
    chat = [r for r in done if r.tenant == "interactive" and r.arrived >= warm]
    ttft = [r.first - r.arrived for r in chat]  # type: ignore[operator]
    bulk = [r for r in done if r.tenant == "batch" and r.end >= warm]
    reasons: dict[str, int] = {}
    for r, why in refused:
        if r.tenant == "interactive" and r.arrived >= warm:
            reasons[why] = reasons.get(why, 0) + 1
    span_s = seconds - warm

    def p99(values: list[float]) -> float | None:
        return percentile(values, 99) if values else None

    return {
        "ttft_p50": percentile(ttft, 50) if ttft else None,
        "ttft_p99": p99(ttft),
        "gateway_wait_p99": p99([r.admitted - r.arrived for r in chat]),  # type: ignore[operator]
        "engine_wait_p99": p99([r.started - r.admitted for r in chat]),  # type: ignore[operator]
        "batch_ahead_p50": percentile([r.batch_ahead for r in chat], 50) if chat else None,
        "interactive": len(chat) + sum(reasons.values()),
        "interactive_refused": reasons,
        "batch_refused": sum(1 for r, _ in refused if r.tenant == "batch" and r.arrived >= warm),
        "batch_output_per_s": sum(r.answer for r in bulk) / span_s,
    }
