"""The SLO gate (routing/gates/slo.py) in the admission pass, on a fake clock: slo-aware
sends a request whose best predicted TTFT is past its budget left to the fallback."""

from __future__ import annotations

import pytest
from kubellm.gateway.routing.admission import Route
from kubellm.gateway.routing.dispatch import admit_once
from kubellm.gateway.routing.gates.slo import SloGate
from kubellm.gateway.routing.router import Router

from tests.gateway.routing.passes import A, B, candidate, make_pass, router, target


@pytest.mark.parametrize(
    ("policy", "fallback", "now", "expected"),
    [
        ("slo-aware", True, 100.0, (Route.REPLICA, "ready")),  # 1 s left: predicted within
        ("slo-aware", True, 100.999999, (Route.FALLBACK, "predicted-ttft")),  # 1 us left
        ("slo-aware", False, 100.999999, (Route.REPLICA, "ready")),  # no fallback: a replica
        ("least-load", True, 100.999999, (Route.REPLICA, "ready")),  # not predicted
    ],
)
def test_the_slo_gate_sends_a_late_request_to_the_fallback(policy, fallback, now, expected):
    routing: Router = router()
    gate = SloGate(routing.predictions, lambda t: ("m", "m", "default"))
    model = target(policy, fallback=fallback)
    p = make_pass(model, [candidate(A), candidate(B, in_flight=1)], now=now)
    decision = admit_once(p, [gate], routing)
    assert decision is not None and (decision.route, decision.reason) == expected
    assert (p.predicted is not None) == (policy == "slo-aware")
    if decision.route is Route.REPLICA:
        assert {c.url for c in decision.order} == {A, B}
