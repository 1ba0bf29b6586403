"""Where each replica's latency prior comes from (routing/latency/predictions.py replica_priors,
LatencyModel.set_priors): its own step costs (a simulated replica's profile), else its
model's status.capacity decode bound (Prior.from_capacity), else the default (H100 8B)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kubellm.gateway.discovery.base import Endpoint, FixedDiscovery, ModelTarget, StepCosts
from kubellm.gateway.routing.latency.model import Dispatch, LatencyModel, Prior
from kubellm.gateway.routing.latency.predictions import Predictions, replica_priors
from kubellm.gateway.routing.scheduler import Scheduler
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"
A100 = StepCosts(0.0118, 94e-6, 0.131e-3, 4096)  # a simulated replica's own figures
SLOW = Prior.from_capacity(50.0)  # status.capacity of a slow card: a 28.6 ms step
DISPATCHES = [
    Dispatch(prompt_tokens=1000),
    Dispatch(prompt_tokens=6000, ahead_tokens=3000, ahead_requests=2, in_flight=19),
    Dispatch(prompt_tokens=1000, waiting=3, running=0, prefill_rate=2000.0),
]


def _target(name: str, *endpoints: Endpoint, bound: float | None = None) -> ModelTarget:
    return ModelTarget(name, name, endpoints=endpoints, decode_tokens_per_second_bound=bound)


# (targets, each URL's prior; URLs left out take the default)
PRIORS_TABLE = [
    # no capacity anywhere: every replica takes the default
    ([_target("m", Endpoint(A))], {}),
    # status.capacity's bound: each of the model's replicas starts from it
    ([_target("m", Endpoint(A), Endpoint(B), bound=50.0)], {A: SLOW, B: SLOW}),
    # a replica's own step costs win over its model's bound
    ([_target("m", Endpoint(A, step_costs=A100), Endpoint(B), bound=50.0)],
     {A: Prior(0.0118, 94e-6, 0.131e-3, 4096), B: SLOW}),
    # two models: one with capacity, one without
    ([_target("m", Endpoint(A), bound=50.0), _target("n", Endpoint(B))], {A: SLOW}),
    # a bound no operator writes (0, not finite) is no prior
    ([_target("m", Endpoint(A), bound=0.0), _target("n", Endpoint(B), bound=float("inf"))], {}),
    # nor one that would make every prediction astronomic or nil (1e-320 tokens/s: a step
    # of 1e320 s, every request out of reach or sent to the fallback at once)
    ([_target("m", Endpoint(A), bound=1e-320), _target("n", Endpoint(B), bound=1e9)], {}),
]  # fmt: skip


@pytest.mark.parametrize(("targets", "priors"), PRIORS_TABLE)
def test_each_replica_takes_its_own_or_its_models_prior(
    targets: list[ModelTarget], priors: dict[str, Prior]
) -> None:
    assert replica_priors(targets) == priors


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_before_any_answer_a_replica_predicts_its_priors_physics(dispatch: Dispatch) -> None:
    predictions = Predictions()
    predictions.follow([_target("m", Endpoint(A), bound=50.0), _target("n", Endpoint(B))])
    model = predictions.model
    busy = SLOW.prefill_token_s * dispatch.prefill_rate
    assert model.predict(A, dispatch) == pytest.approx(
        (SLOW.ttft(dispatch), SLOW.itl(dispatch, busy))
    )
    default = Prior()
    busy = default.prefill_token_s * dispatch.prefill_rate
    assert model.predict(B, dispatch) == pytest.approx(
        (default.ttft(dispatch), default.itl(dispatch, busy))
    )
    assert model.replicas == {}  # reads create nothing
    # created by the first answer's bookkeeping: from the same prior
    assert model.replica(A).prior == SLOW and model.replica(B).prior == default
    assert model.replica(A).predict(dispatch) == model.predict(A, dispatch)


def test_the_prefill_drained_ahead_of_an_unseen_replica_follows_its_prior() -> None:
    """The prompts ahead drain at the replica's own speed, before it has a model."""
    now = [0.0]
    request = RoutingRequest(model="m", prompt_chars=40_000)  # 10,000 tokens
    drained = {}
    for bound in (None, 50.0):
        predictions = Predictions(clock=lambda: now[0])
        predictions.follow([_target("m", Endpoint(A), bound=bound)])
        now[0] = 0.0
        predictions.sent(A, request, Candidate(url=A))
        now[0] = 0.1
        drained[bound] = 10_000 - predictions.dispatch(A, request, Candidate(url=A)).ahead_tokens
    assert drained[50.0] < drained[None]  # a 28.6 ms step computes less in 0.1 s than 7 ms


def test_a_replica_keeps_the_prior_it_learnt_against() -> None:
    """A prior that changes (status.capacity written later) reaches the replicas that
    have learnt nothing; one with answers keeps the prior its factors are relative to."""
    model = LatencyModel()
    model.replica(A)
    model.replica(B).observe(Dispatch(prompt_tokens=500), 0.5, 0.02)
    model.set_priors({A: SLOW, B: SLOW, C: SLOW})
    assert model.replica(A).prior == SLOW  # had learnt nothing
    assert model.replica(B).prior == Prior()
    assert model.replica(C).prior == SLOW  # first seen now
    model.set_priors({})
    assert model.unseen("http://other").prior == Prior()
    assert model.unseen_priors() == [Prior()]  # priors no replica has are not kept


def test_the_scheduler_follows_discovery_into_the_priors() -> None:
    target = _target("m", Endpoint(A), bound=50.0)
    scheduler = Scheduler(FixedDiscovery({"m": target}))
    scheduler.topology_changed()
    model = scheduler.predictions.model
    assert model.priors == {A: SLOW}
    scheduler.discovery.update({"m": replace(target, endpoints=(Endpoint(A), Endpoint(B)))})
    scheduler.topology_changed()
    assert model.priors == {A: SLOW, B: SLOW}
    scheduler.discovery.update({"m": replace(target, decode_tokens_per_second_bound=None)})
    scheduler.topology_changed()
    assert model.priors == {}
