"""spec.routing.policy slo-aware: the ticket trains the latency model, the router ranks by
predicted SLO cost, admission compares the predicted TTFT with the budget, and /metrics
shows predicted against observed."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
from kubellm.gateway.discovery.base import Endpoint, FixedDiscovery, ModelTarget
from kubellm.gateway.routing.admission import Route, decide
from kubellm.gateway.routing.gates.slo import SPEED_EVERY
from kubellm.gateway.routing.latency.model import Dispatch
from kubellm.gateway.routing.router import routing_request
from kubellm.gateway.routing.scheduler import Scheduler
from kubellm.gateway.routing.scorers.base import Candidate

from kubellm.api import SLO, Routing
from kubellm.contracts import FallbackTarget

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"
LABELS = {"model": "tiny", "deployment": "tiny", "namespace": "default"}
RATIO = "kubellm_gateway_predicted_over_observed_ratio"


def _target(*urls: str, policy: str = "slo-aware", fallback: bool = False) -> ModelTarget:
    return ModelTarget(
        "tiny", "tiny", endpoints=tuple(Endpoint(u) for u in urls),
        routing=Routing(policy=policy), slo=SLO(ttft_seconds=1.0, itl_seconds=0.1),
        fallback=FallbackTarget("http://api.example/v1") if fallback else None,
    )  # fmt: skip


def _scheduler(target: ModelTarget) -> Scheduler:
    return Scheduler(FixedDiscovery({"tiny": target}))


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n"


def _value(scheduler: Scheduler, name: str, **labels: str) -> float:
    return scheduler.metrics.registry.get_sample_value(name, {**LABELS, **labels}) or 0.0


async def _stream(scheduler: Scheduler, url: str, ttft: float, gap: float, tokens: int = 5):
    """One streamed answer from `url`, its first token `ttft` after the attempt."""
    target = scheduler.discovery.snapshot()["tiny"]
    routing = routing_request("tiny", {"prompt": "hello " * 200}, None)
    ticket = await scheduler.admit(target, routing, stream=True)
    ticket.attempt(url).started()
    ticket.respond(200)
    start = time.monotonic()
    for i in range(tokens):
        ticket.chunk(_event(f"t{i}"), now=start + ttft + gap * i)
    ticket.finish()
    return ticket


async def test_a_streamed_answer_trains_its_replica_and_shows_the_error() -> None:
    scheduler = _scheduler(_target(A, B))
    await _stream(scheduler, A, ttft=0.5, gap=0.02)
    model = scheduler.predictions.model.replicas[A]
    assert model.samples == 1
    assert model.speed[0] > 1.0  # 0.5 s is slower than the H100 prior's ~50 ms
    assert _value(scheduler, f"{RATIO}_count", url=A, kind="ttft") == 1
    assert _value(scheduler, f"{RATIO}_count", url=A, kind="itl") == 1
    assert _value(scheduler, f"{RATIO}_bucket", url=A, kind="ttft", le="0.5") == 1  # ~0.1
    assert B not in scheduler.predictions.model.replicas
    assert scheduler.predictions.ahead == {}  # its prefill is no longer ahead


async def test_the_first_token_teaches_the_ttft_before_the_answer_ends() -> None:
    """A replica flooded before its first answer ends must not be predicted at the prior
    all that time: its TTFT is learnt at the first token, its error shown with the answer."""
    scheduler = _scheduler(_target(A, B))
    target = scheduler.discovery.snapshot()["tiny"]
    routing = routing_request("tiny", {"prompt": "hello " * 200}, None)
    ticket = await scheduler.admit(target, routing, stream=True)
    ticket.attempt(A).started()
    ticket.respond(200)
    start = time.monotonic()
    ticket.chunk(_event("t0"), now=start + 2.0)  # 2 s to the first token: ~40x the prior
    model = scheduler.predictions.model.replicas[A]
    assert model.predict(Dispatch(prompt_tokens=300))[0] > scheduler.predictions.model.prior.ttft(
        Dispatch(prompt_tokens=300)
    )
    assert model.samples == 0  # a first token, not yet an answer
    for i in range(1, 5):
        ticket.chunk(_event(f"t{i}"), now=start + 2.0 + 0.01 * i)
    ticket.finish()
    assert model.samples == 1
    assert _value(scheduler, f"{RATIO}_count", url=A, kind="ttft") == 1  # once, not twice
    assert _value(scheduler, f"{RATIO}_count", url=A, kind="itl") == 1


def test_a_request_no_replica_keeps_within_the_slo_goes_to_the_busiest() -> None:
    target = _target(A, B, C)
    scheduler = _scheduler(target)
    request = routing_request("tiny", {"prompt": "x" * 8000}, None)
    within = [Candidate(url=A, in_flight=40), Candidate(url=B, in_flight=80), Candidate(url=C)]
    assert scheduler.router.order(target, request, within)[0].url == C  # the most slack
    _learnt(scheduler, A, 30.0)  # every replica far past the 1 s TTFT target
    _learnt(scheduler, B, 30.0)
    _learnt(scheduler, C, 30.0)
    assert scheduler.router.order(target, request, within)[0].url == B  # already worst off


async def test_non_streamed_and_failed_answers_teach_nothing_and_owe_no_prefill() -> None:
    scheduler = _scheduler(_target(A, B))
    target = scheduler.discovery.snapshot()["tiny"]
    routing = routing_request("tiny", {"prompt": "hello " * 200}, None)
    ticket = await scheduler.admit(target, routing, stream=False)
    ticket.attempt(A).started()
    ticket.respond(200)
    ticket.chunk(json.dumps({"choices": [{"text": "x"}]}).encode())
    ticket.finish()
    retried = await scheduler.admit(target, routing, stream=True)
    retried.attempt(A).failed()
    retried.attempt(B).started()
    retried.respond(200)
    retried.finish(broken="reset")
    assert scheduler.predictions.model.replicas == {}
    assert scheduler.predictions.ahead == {}


async def test_speed_factors_reach_metrics_every_few_answers() -> None:
    scheduler = _scheduler(_target(A, B, C))
    for i in range(3 * SPEED_EVERY * 6):  # 96 answers each: the factors' mean has settled
        url = (A, B, C)[i % 3]
        slow = url == C  # 3x slower to the first token and between tokens
        await _stream(scheduler, url, ttft=0.3 if slow else 0.1, gap=0.03 if slow else 0.01)
    speed = "kubellm_gateway_replica_speed_factor"
    assert _value(scheduler, speed, url=C) > 2.0
    assert _value(scheduler, speed, url=A) == pytest.approx(1.0, rel=0.1)


def _learnt(scheduler: Scheduler, url: str, factor: float) -> None:
    model = scheduler.predictions.model
    for i in range(100):
        d = Dispatch(prompt_tokens=100 + 10 * i)
        model.observe(url, d, factor * model.prior.ttft(d), factor * model.prior.itl(d))


def test_slo_aware_ranks_the_replica_that_keeps_the_slo_first() -> None:
    target = _target(A, B, C)
    scheduler = _scheduler(target)
    router = scheduler.router
    _learnt(scheduler, A, 3.0)
    request = routing_request("tiny", {"prompt": "x" * 8000}, None)
    idle = [Candidate(url=u) for u in (A, B, C)]
    order = router.order(target, request, idle)
    assert order[-1].url == A  # 3x slower: last while the others are idle
    # a busy fast replica loses to the slow idle one once its batch costs more
    busy = [Candidate(url=A), Candidate(url=B, in_flight=400), Candidate(url=C, in_flight=400)]
    assert router.order(target, request, busy)[0].url == A
    # prefix-aware, the same state: the slow replica is not known to be slow
    assert {c.url for c in router.order(replace(target, routing=Routing()), request, idle)} == {
        A, B, C
    }  # fmt: skip


def test_a_prefix_held_enters_as_a_shorter_prefill() -> None:
    target = _target(A, B, C)
    scheduler = _scheduler(target)
    request = routing_request("tiny", {"prompt": "system " * 2000 + "question"}, None)
    candidate = Candidate(url=C)
    d = scheduler.predictions.sent(C, request, candidate)
    scheduler.predictions.started(C, d)
    order = scheduler.router.order(target, request, [Candidate(url=u) for u in (A, B, C)])
    assert order[0].url == C


# (unsaturated, predicted TTFT, budget left, fallback room) -> route, reason
ADMISSION = [
    (2, None, 1.0, True, Route.REPLICA, "ready"),  # not slo-aware: as before
    (2, 0.4, 1.0, True, Route.REPLICA, "ready"),  # fits the budget
    (2, 1.5, 1.0, True, Route.FALLBACK, "predicted-ttft"),  # would miss it: the fallback
    (2, 1.5, 1.0, False, Route.REPLICA, "ready"),  # no fallback room: the best replica
    (0, 0.1, 1.0, True, Route.FALLBACK, "saturated"),  # the thresholds still bound
]


@pytest.mark.parametrize(("open_", "predicted", "budget", "room", "route", "reason"), ADMISSION)
def test_admission_compares_the_predicted_ttft_with_the_budget(
    open_: int, predicted: float | None, budget: float, room: bool, route: Route, reason: str
) -> None:
    fallback = FallbackTarget("http://api.example/v1", max_concurrency=4)
    decision = decide(
        ready=2, unsaturated=open_, fallback=fallback, fallback_in_flight=0 if room else 4,
        may_wait=False, budget_left=budget, predicted_ttft=predicted,
    )  # fmt: skip
    assert (decision.route, decision.reason) == (route, reason)


async def test_a_slow_fleet_sends_slo_aware_requests_to_the_fallback_at_once() -> None:
    for policy, route in [("slo-aware", "fallback"), ("prefix-aware", "replica")]:
        target = _target(A, B, policy=policy, fallback=True)
        scheduler = _scheduler(target)
        _learnt(scheduler, A, 200.0)  # a first token in seconds
        _learnt(scheduler, B, 200.0)
        routing = routing_request("tiny", {"prompt": "x" * 20_000}, None)
        ticket = await scheduler.admit(target, routing, stream=True)
        assert ticket.route == route, policy
        ticket.finish()


async def test_replicas_that_left_are_forgotten() -> None:
    target = _target(A, B)
    scheduler = _scheduler(target)
    await _stream(scheduler, A, ttft=0.5, gap=0.02)
    await _stream(scheduler, B, ttft=0.5, gap=0.02)
    scheduler.discovery.update({"tiny": replace(target, endpoints=(Endpoint(B),))})
    scheduler.topology_changed()
    assert set(scheduler.predictions.model.replicas) == {B}
    assert A not in scheduler.predictions.rates and A not in scheduler.predictions.answered_at
