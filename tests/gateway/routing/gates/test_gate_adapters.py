"""The adapter gate (routing/gates/adapters.py) in the admission pass, on a fake clock:
only the replicas holding the request's adapter take it; a load when none has it (the pass
waits for it), no waiting when none will load it."""

from __future__ import annotations

import asyncio

import pytest
from kubellm.gateway.discovery.base import AdapterRef
from kubellm.gateway.routing.admission import Route
from kubellm.gateway.routing.dispatch import admit_once
from kubellm.gateway.routing.gates.adapters import AdapterGate
from kubellm.gateway.routing.replicas import adapters
from prometheus_client import CollectorRegistry

from tests.gateway.routing.passes import A, B, candidate, make_pass, router, target


def _gate(resident: dict[str, set[str]], loader: bool, fail: bool = False) -> AdapterGate:
    view = adapters.AdapterView(stale_after=1e9)
    for url, names in resident.items():
        view.record_registered(url, names)
    metrics = adapters.AdapterMetrics.create(CollectorRegistry())
    loads = adapters.AdapterLoads(view, metrics)

    async def load(url: str, name: str, path: str) -> None:
        if fail:
            raise RuntimeError("the engine refused it")

    loads.loader = load if loader else None
    return AdapterGate(view, loads, metrics, lambda t: ("m", "m", "default"))


MODEL = target(adapters=(AdapterRef("sql", "/adapters/sql"),))
MODEL_FALLBACK = target(fallback=True, adapters=(AdapterRef("sql", "/adapters/sql"),))

# (case, the model, residents, a loader, the first pass: awaits a load / the decision)
CASES = [
    ("resident on b: only b", MODEL, {B: {"sql"}}, True, (Route.REPLICA, "ready", [B])),
    ("nowhere, no loader: no waiting, refused", MODEL, {}, False,
     (Route.REJECT, "no-ready-replicas", [])),
    ("nowhere, no loader, a fallback: the fallback", MODEL_FALLBACK, {}, False,
     (Route.FALLBACK, "no-ready-replicas", [])),
    ("nowhere, a loader: the pass awaits the load", MODEL, {}, True, "awaits"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "resident", "loader", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
async def test_the_adapter_gate(model, resident, loader, expected):
    gate = _gate(resident, loader)
    p = make_pass(model, [candidate(A), candidate(B)], adapter="sql")
    decision = admit_once(p, [gate], router())
    if expected == "awaits":
        assert decision is None and p.awaiting is not None
        await asyncio.wait_for(p.awaiting, 30)
        return
    assert decision is not None
    assert (decision.route, decision.reason, [c.url for c in decision.order]) == expected


@pytest.mark.parametrize(("fail", "expected"), [(False, Route.REPLICA), (True, Route.REJECT)])
async def test_after_its_load_the_pass_goes_to_the_loaded_replica(fail, expected):
    """The load awaited, the next pass sends it where the adapter now is; a failed load
    ends the wait at once (refused, naming the adapter when another load is under way)."""
    gate = _gate({}, loader=True, fail=fail)
    p = make_pass(MODEL, [candidate(A), candidate(B)], adapter="sql")
    assert admit_once(p, [gate], router()) is None
    await asyncio.wait_for(p.awaiting, 30)  # type: ignore[arg-type]
    p.waited = True
    p.refresh(MODEL, [candidate(A), candidate(B)], 100.1, None, 0, 1, True)
    decision = admit_once(p, [gate], router())
    assert decision is not None and decision.route is expected
    if expected is Route.REPLICA:
        assert len(decision.order) == 1 and gate.view.has(decision.order[0].url, "sql")
        assert p.loaded
