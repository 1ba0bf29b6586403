"""The flow-control gate (routing/gates/flow.py) in the admission pass, on a fake clock:
how a tenant's share is enforced (turns, headroom for high bands, the prefill hold, the
band's TTL, drops)."""

from __future__ import annotations

import pytest
from kubellm.gateway.routing.admission import Route
from kubellm.gateway.routing.dispatch import Decision, admit_once
from kubellm.gateway.routing.flow import tenants
from kubellm.gateway.routing.flow.controller import Caller, Tenancy, TenancySettings
from kubellm.gateway.routing.gates.flow import FlowGate
from kubellm.gateway.routing.settings import FlowSettings
from prometheus_client import CollectorRegistry

from tests.gateway.routing.passes import A, B, candidate, make_pass, router, target

DOC = {"tenants": [{"name": "gold", "priority": 1}, {"name": "free", "priority": -1}]}


def _gate(**flow: object) -> FlowGate:
    settings = TenancySettings(tenants.parse(DOC), FlowSettings(**flow))  # type: ignore[arg-type]
    return FlowGate(Tenancy(settings, CollectorRegistry()), wake=lambda: None)


def _caller(gate: FlowGate, name: str) -> Caller:
    assert gate.tenancy is not None
    tenant = gate.tenancy.tenants.get(name)
    assert tenant is not None
    return Caller(tenant, tenant.priority, name, estimate=10)


# (case, flow settings, the replicas, who queued first, the fallback, now, prefilling,
#  the free tenant's decision: (route, reason), or None: it waits)
CASES = [
    ("its turn, room below the line", {}, [candidate(A), candidate(B)], None, False, 100.0, {},
     (Route.REPLICA, "ready")),
    ("a high band queued first: not its turn, waits", {}, [candidate(A)], "gold", False, 100.0,
     {}, None),
    ("not its turn nor next for the fallback: waits", {}, [candidate(A)], "gold", True, 100.0,
     {}, None),
    ("every replica above the headroom line: waits for one, no fallback", {},
     [candidate(A, kv=0.85)], None, True, 100.0, {}, None),
    ("a replica above the line, one below: the one below", {},
     [candidate(A, kv=0.85), candidate(B)], None, False, 100.0, {}, (Route.REPLICA, "ready")),
    ("a high band's stream awaiting its first token holds the replica", {},
     [candidate(A)], None, False, 100.0, {A: 1}, None),
    ("hold_prefill off: it goes", {"hold_prefill": False}, [candidate(A)], None, False, 100.0,
     {A: 1}, (Route.REPLICA, "ready")),
    ("saturated at its TTL's end: ttl", {"ttl_seconds": 0.5}, [candidate(A, waiting=9)], None,
     False, 100.5, {}, (Route.REJECT, "ttl")),
    ("saturated before: it waits", {"ttl_seconds": 0.5}, [candidate(A, waiting=9)], None, False,
     100.2, {}, None),
    ("its band is full: dropped", {"max_band": 1}, [candidate(A)], "free", False, 100.0, {},
     (Route.REJECT, "band-full")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("flow", "replicas", "first", "fallback", "now", "prefilling", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_the_flow_gate(flow, replicas, first, fallback, now, prefilling, expected):
    gate = _gate(**flow)
    gate.prefilling.update(prefilling)
    model = target(fallback=fallback)
    if first is not None:  # someone queued ahead
        ahead = make_pass(model, replicas, caller=_caller(gate, first))
        gate.enter(ahead)
    p = make_pass(model, replicas, now=now, caller=_caller(gate, "free"))
    gate.enter(p)
    decision = admit_once(p, [gate], router())
    got = None if decision is None else (decision.route, decision.reason)
    assert got == expected
    gate.leave(p)


def test_without_tenants_the_flow_gate_lets_all_by():
    gate = FlowGate(None, wake=lambda: None)
    p = make_pass(target(), [candidate(A, kv=0.85)])
    gate.enter(p)
    assert admit_once(p, [gate], router()) == Decision(Route.REPLICA, "ready", p.open)


def test_a_dispatch_counts_the_tenant_in_flight():
    gate = _gate(fair_in_flight_tokens=100)
    caller = _caller(gate, "free")
    p = make_pass(target(), [candidate(A)], caller=caller)
    gate.enter(p)
    decision = admit_once(p, [gate], router())
    assert decision is not None and decision.route is Route.REPLICA
    assert caller.holding is not None and caller.charged == 10


async def test_a_request_dropped_by_flow_control_is_refused_with_429():
    """Through the scheduler: a request whose band is full is dropped at once, a 429 that
    says why (on main the drop path returned four values where admit unpacked five: a
    500 from the front end)."""
    import asyncio

    from kubellm.gateway.discovery.base import FixedDiscovery
    from kubellm.gateway.routing.flow.queues import DROP_HEADER
    from kubellm.gateway.routing.scheduler import Scheduler, SchedulerSettings

    settings = TenancySettings(tenants.parse(DOC), FlowSettings(max_band=1, ttl_seconds=30))
    model = target()
    scheduler = Scheduler(FixedDiscovery({"m": model}), SchedulerSettings(tenancy=settings))
    assert scheduler.tenancy is not None
    free = scheduler.tenancy.tenants.get("free")
    assert free is not None
    routing = make_pass(model, []).routing
    scheduler.flow.prefilling.update({A: 1, B: 1})  # the free band waits: both replicas held
    first = asyncio.create_task(scheduler.admit(model, routing, caller=Caller(free, -1, "free")))
    while not scheduler.queued.get("m"):  # the first one waits in its band
        await asyncio.sleep(0.01)
    ticket = await scheduler.admit(model, routing, caller=Caller(free, -1, "free"))
    assert ticket.refusal is not None and ticket.refusal.status == 429
    assert ticket.refusal.headers[DROP_HEADER] == "band-full"
    scheduler.flow.prefilling.clear()  # the high band's streams began: the first one goes
    scheduler.wake()
    ticket = await asyncio.wait_for(first, 60)
    assert ticket.route == "replica"
    ticket.finish()


def _sent(gate: FlowGate, name: str, url: str, now: float) -> None:
    """A dispatch of tenant `name`'s request (estimate 10 prompt tokens) to `url` at `now`."""
    from types import SimpleNamespace

    from kubellm.gateway.routing.gates import flow as flow_gate

    ticket = SimpleNamespace(caller=_caller(gate, name), target=target(), stream=False,
                             done=False, hold=None)  # fmt: skip
    real = flow_gate.time
    flow_gate.time = SimpleNamespace(monotonic=lambda: now)  # type: ignore[assignment]
    try:
        gate.sent(ticket, url)  # type: ignore[arg-type]
    finally:
        flow_gate.time = real


def _low_goes(gate: FlowGate, now: float) -> bool:
    p = make_pass(target(), [candidate(A)], now=now, start=now, caller=_caller(gate, "free"))
    gate.enter(p)
    decision = admit_once(p, [gate], router())
    gate.leave(p)
    return decision is not None and decision.route is Route.REPLICA


# (case, flow settings, the replica's learnt prefill speed, a high band sent at, the free
#  tenant's second request goes at once)
PACED = [
    ("learnt speed, a high band about: paced", {}, 100.0, 99.0, False),
    ("learnt speed, no high band: not paced (batch alone loses nothing)", {}, 100.0, None,
     True),
    ("learnt speed, the high band gone past HIGH_RECENT_S: not paced", {}, 100.0, 60.0, True),
    ("nothing learnt yet: not paced", {}, None, 99.0, True),
    ("--headroom-prefill-rate off: not paced", {"headroom_prefill_learnt": False}, 100.0,
     99.0, True),
    ("--headroom-prefill-rate N: paced, a high band or not", {"headroom_prefill_rate": 100.0},
     None, None, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("flow", "speed", "high_at", "goes"),
    [case[1:] for case in PACED],
    ids=[case[0] for case in PACED],
)
def test_the_prefill_budget_paces_low_bands_only_beside_a_high_band(flow, speed, high_at, goes):
    settings = TenancySettings(tenants.parse(DOC), FlowSettings(**flow))
    gate = FlowGate(Tenancy(settings, CollectorRegistry()), lambda: None, lambda url: speed)
    if high_at is not None:
        _sent(gate, "gold", B, high_at)
    _sent(gate, "free", A, 100.0)  # 10 prompt tokens owed: 0.1 s at 100 tokens/s
    assert _low_goes(gate, 100.0) is goes
    assert _low_goes(gate, 100.2)  # drained


@pytest.mark.parametrize(("share", "drained_at"), [(0.0, 100.1), (0.5, 100.05), (0.9, 100.01)])
def test_a_low_bands_prompt_owes_only_its_part_not_cached_on_the_replica(share, drained_at):
    # The learnt speed counts computed prompt tokens (a cache hit costs no prefill), so a
    # prompt owes what the replica will compute: 10 tokens, `share` of them cached there.
    settings = TenancySettings(tenants.parse(DOC), FlowSettings())
    gate = FlowGate(Tenancy(settings, CollectorRegistry()), lambda: None, lambda url: 100.0,
                    cached_share=lambda url, ticket: share if url == A else 0.0)  # fmt: skip
    _sent(gate, "gold", B, 99.0)  # a high band about: the budget paces
    _sent(gate, "free", A, 100.0)
    assert not _low_goes(gate, drained_at - 0.005)
    assert _low_goes(gate, drained_at + 0.005)
