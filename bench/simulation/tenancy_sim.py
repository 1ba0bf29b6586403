"""Fair shares on a simulated clock: the gateway's flow control (`routing/flow.py`: the
queues, the virtual token counters, the fair in-flight budget and its derived default)
in front of simulated replicas (`kubellm.engine.sim_core`), no process and no wall clock,
so the figures do not depend on the machine's load (bench/gateway/tenancy.py runs the same
fairness phase through real gateway and simulator processes, in scaled wall time).

Tenants of one band keep `--outstanding` requests each outstanding (closed loop, not
streamed), each tenant its own prompt size and 100-token answers. Each pass is the flow
gate's (`gates/flow.py`): the head of the flow by counter, passing over the tenants held
at their fair in-flight share (`Flow.held` of `fair_capacity`), goes to the least-loaded
replica that is not saturated (`admission.saturated`: scraped queue >= 4, KV >= 0.95);
passes run on an arrival, a finished request and a scrape (every 1 s, as the gateway's).
Counters are charged as `tenancy.py` charges them (the prompt at dispatch, the rest at the
end). Printed per workload and contender: each tenant's share of the service (prompt + 2 x
output tokens) finished after the first --warm s, Jain's index over share / weight, the
fleet's service, prompt and output tokens per second, and the p99 latency of the tenant
with the shortest prompts. Contenders: `shipped` (the default: the budget derived from
the pool, `fair_capacity`), `off` (`--fair-in-flight-tokens off`: counters only), and
`qQxK` (the derived rule at quantile Q, `FAIR_QUANTILE`, and K slots, `FAIR_SLOTS`),
`N` (a fixed budget per replica).

The interference scenario (`--scenarios interference`, bench/simulation/interference.py) runs
the gateway's own admission pass with its flow gate, load view and router (not a copy of
them) on the same clock: an interactive tenant (priority 10) beside a batch tenant (-1),
the issue's tenants file, per mix (`--mixes`: the issue's shape and mixes not tuned on)
and contender (`shipped`: the defaults, the prefill budget at each replica's learnt speed;
`unpaced`: `--headroom-prefill-rate off`, the shipped line until 2026-12-03; `before`:
unpaced with the low band's line as it was before the ramp, `queues.LOW_RAMP` infinite;
`prefill-N`: `--headroom-prefill-rate N`).
Printed: the chats' TTFT p50/p99 alone and beside the batch, the chats refused (with the
reason), the batch's output tokens/s alone and beside the chats, and where the chats'
p99 was (the wait at the gateway, the wait in the engine before its first step).

    python -m bench.tenancy_sim                       # every workload, every contender
    python -m bench.tenancy_sim --workloads issue --contenders shipped,off --seconds 120
    python -m bench.tenancy_sim --scenarios interference --mixes issue --seconds 40 --warm 10
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from kubellm.engine import sim_core, sim_profiles
from kubellm.gateway.routing.admission import saturated
from kubellm.gateway.routing.flow import queues as flows
from kubellm.gateway.routing.scorers.base import Candidate
from kubellm.gateway.routing.settings import Thresholds

from kubellm.bench.stats import percentile

H100 = sim_profiles.get("llama-3.1-8b-h100").with_overrides(max_num_seqs=16)
ANSWER = 100


@dataclass(frozen=True)
class Workload:
    sizes: tuple[int, ...]  # each tenant's prompt tokens
    weights: tuple[float, ...] = (1.0, 1.0, 1.0)
    outstanding: int = 32  # per tenant
    slow: int = 0  # replicas (of 4) slowed 1.5x


# `issue`: issue 38's fairness phase (the shape the default was chosen on); the rest were
# not tuned on: other prompt mixes, weights, fewer outstanding, replicas that differ.
WORKLOADS = {
    "issue": Workload((200, 2000, 8000)),
    "mix-300-1500-6000": Workload((300, 1500, 6000)),
    "mix-1000-4000-16000": Workload((1000, 4000, 16000)),
    "equal-2000": Workload((2000, 2000, 2000)),
    "weights-2-1-1": Workload((200, 2000, 8000), (2.0, 1.0, 1.0)),
    "8-outstanding": Workload((200, 2000, 8000), outstanding=8),
    "2fast2slow": Workload((200, 2000, 8000), slow=2),
}


def run(work: Workload, contender: str, seconds: float, warm: float) -> dict[str, Any]:
    settings = flows.FlowSettings()
    slots, quantile = flows.FAIR_SLOTS, flows.FAIR_QUANTILE
    if contender == "off":
        settings = replace(settings, fair_in_flight=False)
    elif contender.startswith("q"):  # qQxK: the derived rule at quantile Q, K slots
        q, k = contender[1:].split("x")
        quantile, slots = float(q), float(k)
    elif contender != "shipped":
        settings = replace(settings, fair_in_flight_tokens=float(contender))
    profiles = [H100] * (4 - work.slow) + [H100.slowed(1.5)] * work.slow
    engines = [sim_core.Engine(p) for p in profiles]
    in_flight = [0] * len(engines)
    scraped: list[tuple[float, float, float] | None] = [None] * len(engines)
    busy = [False] * len(engines)
    flow = flows.Flow(settings)
    names = [f"t{i}" for i in range(len(work.sizes))]
    live: dict[str, tuple[str, int, float, float, int]] = {}  # id -> tenant, replica, ...
    events: list[tuple[float, int, str, Any]] = []
    seq = 0
    next_token = 0
    finished: list[tuple[float, str, int, float]] = []  # end, tenant, service, latency

    def push(t: float, kind: str, payload: Any = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    def submit(tenant: str, now: float) -> None:
        i = names.index(tenant)
        service = work.sizes[i] + flows.OUTPUT_WEIGHT * ANSWER
        flow.join(flows.Waiter(tenant, 0, work.weights[i], work.sizes[i], service=service))
        flow.queues[0][tenant][-1].arrived = now  # type: ignore[attr-defined]

    def candidates() -> list[Candidate]:
        out = []
        for r in range(len(engines)):
            running, waiting, kv = scraped[r] or (None, None, None)
            load = in_flight[r] if running is None else max(in_flight[r], running + waiting)
            out.append(Candidate(f"r{r}", load, in_flight[r], waiting, kv, running))
        return out

    def pump(now: float) -> None:
        nonlocal next_token
        flow.learn(candidates())  # as the gate does on each pass
        while True:
            cands = candidates()
            capacity = None
            if settings.fair_in_flight:
                capacity = _capacity(settings, flow, cands, slots, quantile)
            held = flow.held(capacity) if capacity else frozenset()
            waiter = flow.head(held=held)
            open_ = [c for c in cands if not saturated(c, Thresholds())]
            if waiter is None or not open_:
                return
            best = min(open_, key=lambda c: (c.load, c.in_flight))
            r = int(best.url[1:])
            flow.leave(waiter)
            flow.charge(waiter.tenant, waiter.cost, waiter.weight)
            flow.started(0, waiter.tenant, waiter.service)
            i = names.index(waiter.tenant)
            rid = f"q{seq}-{next_token}"
            size = work.sizes[i]
            tokens = list(range(next_token, next_token + size))  # unique: no prefix hits
            next_token += size
            live[rid] = (waiter.tenant, r, waiter.service, waiter.arrived, size)  # type: ignore[attr-defined]
            in_flight[r] += 1
            engines[r].add(sim_core.Request(rid, tokens, ANSWER, arrival=now))
            if not busy[r]:
                busy[r] = True
                push(now, "step", r)

    for t in range(int(seconds) + 1):
        push(float(t), "scrape")
    for tenant in names:
        for _ in range(work.outstanding):
            submit(tenant, 0.0)
    push(0.0, "pump")
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if now > seconds:
            break
        if kind == "scrape":
            for r, e in enumerate(engines):
                scraped[r] = (float(len(e.running)), float(len(e.waiting)), e.kv_cache_usage())
            pump(now)
        elif kind == "pump":
            pump(now)
        elif kind == "step":
            step = engines[payload].step()
            push(now + step.duration, "done", (payload, step))
        else:
            r, step = payload
            for request in step.finished:
                tenant, _, service, arrived, size = live.pop(request.request_id)
                in_flight[r] -= 1
                flow.ended(0, tenant, service)
                i = names.index(tenant)
                served = size + flows.OUTPUT_WEIGHT * len(request.output)
                flow.charge(tenant, served - size, work.weights[i])
                finished.append((now, tenant, served, now - arrived))
                submit(tenant, now)
            if engines[r].has_work:
                push(now, "step", r)
            else:
                busy[r] = False
            pump(now)
    counted = [f for f in finished if f[0] >= warm]
    span = seconds - warm
    service = {t: sum(f[2] for f in counted if f[1] == t) for t in names}
    total = sum(service.values()) or 1.0
    shares = {t: service[t] / total for t in names}
    values = [shares[t] / w for t, w in zip(names, work.weights, strict=True)]
    jain = sum(values) ** 2 / (len(values) * sum(v * v for v in values))
    small = names[min(range(len(names)), key=lambda i: work.sizes[i])]
    latencies = [f[3] for f in counted if f[1] == small]
    return {
        "contender": contender,
        "shares": [shares[t] for t in names],
        "jain": jain,
        "service_per_s": total / span,
        "prompt_per_s": sum(work.sizes[names.index(f[1])] for f in counted) / span,
        "output_per_s": sum((f[2] - work.sizes[names.index(f[1])]) / 2 for f in counted) / span,
        "small_p99": percentile(latencies, 99) if latencies else None,
        "budget_per_replica": (
            (budget := _capacity(settings, flow, candidates(), slots, quantile))
            and budget / len(engines)
        ),
    }


def _capacity(
    settings: flows.FlowSettings,
    flow: flows.Flow,
    candidates: list[Candidate],
    slots: float,
    quantile: float,
) -> float | None:
    """`fair_capacity` with the rule's two constants set to `slots` and `quantile`."""
    old = flows.FAIR_SLOTS, flows.FAIR_QUANTILE
    flows.FAIR_SLOTS, flows.FAIR_QUANTILE = slots, quantile
    flow._typical = None  # the cached quantile was another's
    try:
        return flows.fair_capacity(settings, flow, candidates)
    finally:
        flows.FAIR_SLOTS, flows.FAIR_QUANTILE = old
        flow._typical = None


def interference(args: argparse.Namespace) -> dict[str, Any]:
    """The interference phase per mix: the chats alone (no batch: the same for every
    contender), then per contender the batch alone and both."""
    from bench.simulation import interference as sim

    out: dict[str, Any] = {}
    print(f"interference: 4 x llama-3.1-8b-h100 (maxNumSeqs 16), tenants interactive "
          f"(priority 10), batch (-1), three at 0; {args.seconds:g} simulated s per phase, the "
          f"first {args.warm:g} not counted; the gateway's pass and flow gate")  # fmt: skip
    print(f"{'mix':21} {'contender':13} {'p50 alone':>9} {'p99 alone':>9} {'p50 both':>8} "
          f"{'p99 both':>8} {'p99 x':>6} {'chats refused':>17} {'batch tok/s':>11} "
          f"{'both':>6} {'both/alone':>10} {'gw wait':>7} {'engine wait':>11}")  # fmt: skip
    for name in args.mixes.split(","):
        mix = sim.MIXES[name]
        run_ = partial(sim.run, mix, seconds=args.seconds, warm=args.warm, profile=H100)
        alone = run_(sim.contender("shipped"), True, False)
        for contender in args.interference_contenders.split(","):
            settings = sim.contender(contender)
            ramp = flows.LOW_RAMP
            flows.LOW_RAMP = math.inf if contender == "before" else ramp
            try:
                batch = run_(settings, False, True)
                both = run_(settings, True, True)
            finally:
                flows.LOW_RAMP = ramp
            out.setdefault(name, []).append(
                {"contender": contender, "alone": alone, "batch_alone": batch, "both": both}
            )
            ratio = both["ttft_p99"] / alone["ttft_p99"]
            kept = both["batch_output_per_s"] / batch["batch_output_per_s"]
            refused = f"{sum(both['interactive_refused'].values())}/{both['interactive']}"
            if both["interactive_refused"]:
                refused += " " + ",".join(both["interactive_refused"])
            print(f"{name:21} {contender:13} {alone['ttft_p50']:>9.3f} {alone['ttft_p99']:>9.3f} "
                  f"{both['ttft_p50']:>8.3f} {both['ttft_p99']:>8.3f} {ratio:>6.1f} "
                  f"{refused:>17} {batch['batch_output_per_s']:>11.0f} "
                  f"{both['batch_output_per_s']:>6.0f} {kept:>10.0%} "
                  f"{both['gateway_wait_p99']:>7.3f} {both['engine_wait_p99']:>11.3f}",
                  flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="fairness,interference")
    parser.add_argument("--mixes", default="issue,batch-256,chat-16/s,chat-not-streamed,"
                        "mix-150-200/3000-100,2fast2slow")  # fmt: skip
    parser.add_argument("--interference-contenders", default="shipped,unpaced,prefill-15000")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--contenders", default="shipped,off,q0.5x1.5,q0.25x1,q0.25x2,q0.1x1.5")
    parser.add_argument("--seconds", type=float, default=90.0, help="simulated s per run")
    parser.add_argument("--warm", type=float, default=15.0, help="simulated s not counted")
    parser.add_argument("--out", default="bench/results/tenancy_sim.json")
    args = parser.parse_args(argv)
    rows: dict[str, list[dict[str, Any]]] = {}
    print(f"4 x llama-3.1-8b-h100 (maxNumSeqs 16), {ANSWER}-token answers, not streamed; "
          f"{args.seconds:g} simulated s, the first {args.warm:g} not counted; shipped: the "
          f"derived budget, FAIR_SLOTS {flows.FAIR_SLOTS:g}")  # fmt: skip
    print(f"{'workload':20} {'contender':9} {'shares':>20} {'jain':>6} {'service/s':>9} "
          f"{'prompt/s':>8} {'output/s':>8} {'short p99 s':>11} "
          f"{'budget/replica':>14}")  # fmt: skip
    if "interference" in args.scenarios.split(","):
        rows["interference"] = interference(args)  # type: ignore[assignment]
    if "fairness" not in args.scenarios.split(","):
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        return 0
    for name in args.workloads.split(","):
        work = WORKLOADS[name]
        for contender in args.contenders.split(","):
            row = run(work, contender, args.seconds, args.warm)
            rows.setdefault(name, []).append(row)
            shares = "/".join(f"{s:.1%}" for s in row["shares"])
            budget = row["budget_per_replica"]
            print(f"{name:20} {contender:9} {shares:>20} {row['jain']:>6.3f} "
                  f"{row['service_per_s']:>9.0f} {row['prompt_per_s']:>8.0f} "
                  f"{row['output_per_s']:>8.0f} {row['small_p99'] or 0:>11.2f} "
                  f"{'-' if budget is None else f'{budget:,.0f}':>14}", flush=True)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
