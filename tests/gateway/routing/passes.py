"""Helpers for the admission pass's table tests: a model, a router, and a pass on a fake
clock (the pass reads no clock: `now` is given)."""

from __future__ import annotations

import random

from kubellm.gateway.discovery.base import Endpoint, FallbackTarget, ModelTarget
from kubellm.gateway.routing.dispatch import Pass
from kubellm.gateway.routing.replicas.load import LoadView
from kubellm.gateway.routing.replicas.outliers import OutlierDetector
from kubellm.gateway.routing.router import Router, routing_request
from kubellm.gateway.routing.scorers.base import Candidate

from kubellm.api import SLO, Routing

A, B = "http://a", "http://b"
FALLBACK = FallbackTarget("http://api.example/v1")


def target(policy: str = "least-load", fallback: bool = False, **kw: object) -> ModelTarget:
    return ModelTarget(
        "m", "m", endpoints=(Endpoint(A), Endpoint(B)), routing=Routing(policy=policy),
        slo=SLO(ttft_seconds=1.0, itl_seconds=0.1),
        fallback=FALLBACK if fallback else None, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def router() -> Router:
    return Router(LoadView(), OutlierDetector(), random.Random(0))


def candidate(
    url: str, in_flight: int = 0, kv: float | None = None, waiting: float = 0
) -> Candidate:
    return Candidate(url=url, in_flight=in_flight, load=in_flight, kv_usage=kv, waiting=waiting)


def make_pass(
    model: ModelTarget,
    candidates: list[Candidate],
    now: float = 100.0,
    start: float = 100.0,
    adapter: str | None = None,
    caller: object = None,
    **kw: object,
) -> Pass:
    """A pass for a request arriving at `start` with a 1 s budget, looked at `now`."""
    request = routing_request("m", {"prompt": "hello " * 50}, None, adapter=adapter)
    p = Pass(model, request, start, start + 1.0, True, caller=caller)  # type: ignore[arg-type]
    p.refresh(model, candidates, now, model.fallback, 0, 1, True)
    for name, value in kw.items():
        setattr(p, name, value)
    return p
