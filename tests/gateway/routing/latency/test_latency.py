"""The latency model (routing/latency/model.py): its prior, its forgetting, stale inputs (its
cost per decision is measured by bench/gateway/slo_routing.py, not asserted)."""

from __future__ import annotations

import math

import pytest
from kubellm.gateway.routing.latency.model import (
    MIN_SAMPLES_FOR_SPEED,
    OUT_OF_REACH,
    RATE,
    Dispatch,
    LatencyModel,
    Prior,
    ReplicaModel,
    slo_cost,
    slo_scores,
    speed_factors,
)
from kubellm.gateway.routing.latency.predictions import Predictions
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest

H100 = Prior()  # the H100 8B profile's step costs: 7 ms, 32 us / prompt token, 80 us / seq

# (dispatch, TTFT and ITL from the prior, by hand from the formula in the module)
PRIOR_TABLE = [
    # idle replica, 1,000-token prompt: 1.5 steps of (7 ms + 80 us) + 1,000 x 32 us
    (Dispatch(prompt_tokens=1000), 1.5 * 0.00708 + 0.032, 0.00708),
    # the replica holds 800 of them: only 200 are computed
    (Dispatch(prompt_tokens=1000, cached_tokens=800), 1.5 * 0.00708 + 0.0064, 0.00708),
    # 3,000 tokens ahead of it, a batch of 20 (19 in flight + itself)
    (Dispatch(prompt_tokens=1000, ahead_tokens=3000, ahead_requests=2, in_flight=19),
     1.5 * (0.007 + 20 * 80e-6) + 4000 * 32e-6, 0.007 + 20 * 80e-6 + 3000 * 32e-6 / 100),
    # 10,000 tokens to compute: two steps of 8,192 tokens, then the first token
    (Dispatch(prompt_tokens=10_000), 2.5 * 0.00708 + 0.32, 0.00708),
    # 3 queued there by other gateways (engine queue 3, none of this gateway's waiting)
    (Dispatch(prompt_tokens=1000, waiting=3, running=0),
     1.5 * 0.00708 + 0.032 + 3 * (0.007 + 250 * 32e-6), 0.00708),
]  # fmt: skip


@pytest.mark.parametrize(("dispatch", "ttft", "itl"), PRIOR_TABLE)
def test_a_new_replica_predicts_from_the_prior(dispatch: Dispatch, ttft: float, itl: float) -> None:
    model = LatencyModel(H100)
    assert model.predict("http://new", dispatch) == pytest.approx((ttft, itl))
    assert model.replicas == {}  # a read creates nothing


@pytest.mark.parametrize(
    ("bound", "step"),
    [(143.0, 1 / (0.7 * 143)), (50.0, 1 / 35)],  # 7B bf16 at 2,000 GB/s; a slower card
)
def test_the_prior_from_status_capacity_scales_with_the_decode_bound(
    bound: float, step: float
) -> None:
    prior = Prior.from_capacity(bound)
    assert prior.step_base_s == pytest.approx(step)
    assert prior.prefill_token_s == pytest.approx(step / 220)
    for bad in (0.0, -1.0, math.nan, 1e-320, 1e9):
        with pytest.raises(ValueError, match="decodeTokensPerSecondBound"):
            Prior.from_capacity(bad)


def _feed(model: ReplicaModel, factor: float, answers: int) -> None:
    """Answers from a replica `factor` times slower than the prior's physics."""
    for i in range(answers):
        d = Dispatch(prompt_tokens=200 + 37 * (i % 50), in_flight=i % 16)
        model.observe(d, factor * H100.ttft(d), factor * H100.itl(d))


# (answers at factor 1.5, then answers at factor 1.0, the TTFT and ITL learnt within 6%)
FORGETTING_TABLE = [
    (0, 0, 1.0),  # nothing seen: the prior
    (200, 0, 1.5),  # a slow replica learnt
    (200, 200, 1.0),  # it recovered: 200 later answers outweigh the 200 old ones
    # 5 answers in: log k's old part x (1 - RATE) per answer (each TTFT's error is shared
    # between the step and the prefill factor as their parts make up its prediction)
    (200, 5, 1.5 ** ((1 - RATE) ** 5)),
]


@pytest.mark.parametrize(("slow", "fast", "speed"), FORGETTING_TABLE)
def test_old_answers_fade(slow: int, fast: int, speed: float) -> None:
    model = ReplicaModel(H100)
    _feed(model, 1.5, slow)
    _feed(model, 1.0, fast)
    for d in (Dispatch(prompt_tokens=1234, in_flight=5), Dispatch(prompt_tokens=60)):
        ttft, itl = model.predict(d)
        assert ttft / H100.ttft(d) == pytest.approx(speed, rel=0.06)
        assert itl / H100.itl(d) == pytest.approx(speed, rel=0.06)


# (per-step factor, per-prompt-token factor of a replica; 400 answers of mixed lengths)
TWO_FACTOR_TABLE = [
    (1.0, 1.0),
    (1.5, 1.5),  # a card 1.5x slower in everything
    (1.6, 3.2),  # an A100 against the H100 prior: prompts 3.2x slower, steps 1.6x
]


@pytest.mark.parametrize(("k_step", "k_prefill"), TWO_FACTOR_TABLE)
def test_steps_and_prompts_are_learnt_apart(k_step: float, k_prefill: float) -> None:
    """A short prompt's TTFT is mostly steps, a long one's mostly prefill: both factors
    are learnt, so short and long prompts are both predicted right."""
    slower = Prior(
        H100.step_base_s * k_step, H100.prefill_token_s * k_prefill, H100.decode_token_s * k_step
    )
    model = ReplicaModel(H100)
    for i in range(400):
        d = Dispatch(prompt_tokens=50 + 397 * (i % 20), in_flight=i % 16)
        model.observe(d, slower.ttft(d), slower.itl(d))
    for d in (Dispatch(prompt_tokens=50), Dispatch(prompt_tokens=6000, in_flight=8)):
        assert model.predict(d)[0] == pytest.approx(slower.ttft(d), rel=0.08)
    assert model.speed == pytest.approx((k_step, k_prefill), rel=0.15)


def test_one_stalled_answer_moves_the_factor_by_a_bounded_step() -> None:
    model = ReplicaModel(H100)
    d = Dispatch(prompt_tokens=500)
    before = model.predict(d)[0]
    model.observe(d, 1000 * H100.ttft(d), None)  # a stream that stalled for minutes
    after = model.predict(d)[0]
    # one RATE step of at most log 4 (shared between the two factors: each moves less)
    assert 1.0 < after / before <= 4.0**RATE
    model.observe(d, math.inf, math.nan)  # and nonsense teaches nothing
    model.observe(d, -1.0, 0.0)
    assert model.predict(d)[0] == after
    assert 1.0 <= model.predict(d)[1] / H100.itl(d) <= 4.0**RATE  # the steps are shared


# (engine figures: running, waiting; fresh or stale) -> what the model uses
STALE_TABLE = [
    # fresh: running 30 > this gateway's 10 in flight: a batch of 31; 2 queued by others
    (30.0, 3.0, 31.0, 2.0),
    # stale (None): the gateway's own in-flight count, nobody else's queue
    (None, None, 11.0, 0.0),
    # fresh but lagging: the engine reports fewer running than are in flight from here
    (4.0, 0.0, 11.0, 0.0),
    # a scrape from before this gateway's queue began to run: 8 waiting then, 1 of its
    # own waiting now, but the engine's 12 are 10 of this gateway's and 2 others'
    (4.0, 8.0, 11.0, 2.0),
]


@pytest.mark.parametrize(("running", "waiting", "batch", "others"), STALE_TABLE)
def test_stale_engine_figures_are_unknown_not_zero(
    running: float | None, waiting: float | None, batch: float, others: float
) -> None:
    d = Dispatch(prompt_tokens=100, in_flight=10, ahead_requests=1, running=running,
                 waiting=waiting)  # fmt: skip
    assert (d.batch, d.others) == (batch, others)


def test_predictions_treat_a_candidate_with_stale_metrics_as_unknown() -> None:
    """A replica whose last scrape is stale reports None (router.candidates): its old
    queue of 50 must not count, its in-flight count does."""
    predictions = Predictions()
    request = RoutingRequest(model="m", prompt_chars=4000)
    stale = Candidate(url="http://a", in_flight=3, running=None, waiting=None)
    fresh_busy = Candidate(url="http://a", in_flight=3, running=40.0, waiting=50.0)
    assert predictions.dispatch("http://a", request, stale).batch == 4.0
    ttft_stale = predictions.model.predict(
        "http://a", predictions.dispatch("http://a", request, stale)
    )
    ttft_busy = predictions.model.predict(
        "http://a", predictions.dispatch("http://a", request, fresh_busy)
    )
    assert ttft_stale < ttft_busy


def test_speed_factors_name_the_slow_replica_once_it_has_answers() -> None:
    models = {}
    for url, factor in [("a", 1.0), ("b", 1.0), ("c", 1.6), ("d", 1.0)]:
        models[url] = ReplicaModel(H100)
        _feed(models[url], factor, 200)
    speeds = speed_factors(models)
    assert speeds["c"] == pytest.approx(1.6, rel=0.05)
    assert all(speeds[u] == pytest.approx(1.0, rel=0.05) for u in "abd")
    young = {"a": models["a"], "e": ReplicaModel(H100)}
    _feed(young["e"], 3.0, MIN_SAMPLES_FOR_SPEED - 1)
    assert speed_factors(young) == {}  # e has too few answers; a alone has no peers


@pytest.mark.parametrize(
    ("ttft", "itl", "cost"), [(0.5, 0.01, 0.5), (0.1, 0.1, 2.0), (1.0, 0.05, 1.0)]
)
def test_slo_cost_is_the_worse_of_the_two_ratios(ttft: float, itl: float, cost: float) -> None:
    assert slo_cost(ttft, itl, ttft_target=1.0, itl_target=0.05) == pytest.approx(cost)


def test_prefix_held_enters_through_the_uncached_part() -> None:
    predictions = Predictions()
    request = RoutingRequest(model="m", chunk_hashes=tuple(range(40)), prompt_chars=40 * 256)
    holder, other = Candidate(url="http://holder"), Candidate(url="http://other")
    predictions.sent("http://holder", request, holder)
    predictions.started("http://holder", predictions.dispatch("http://holder", request, holder))
    costs = predictions.costs(request, [holder, other], 1.0, 0.05)
    assert predictions.dispatch("http://holder", request, holder).uncached == 0
    assert costs["http://holder"][1] < costs["http://other"][1]


def test_ahead_counts_what_has_not_begun_to_stream() -> None:
    predictions = Predictions()
    request = RoutingRequest(model="m", prompt_chars=4000)
    a = Candidate(url="http://a")
    first = predictions.sent("http://a", request, a)
    second = predictions.sent("http://a", request, a)
    assert (second.ahead_tokens, second.ahead_requests) == (1000, 1)
    predictions.started("http://a", first)
    predictions.abandoned("http://a", second)
    assert predictions.dispatch("http://a", request, a).ahead_tokens == 0


# (each candidate's SLO cost) -> the order the `slo` scorer puts them in
SCORES_TABLE = [
    ({"a": 0.3, "b": 0.9, "c": 2.0}, ["a", "b", "c"]),  # within reach: the most slack first
    ({"a": 1.0, "b": 1.4}, ["a", "b"]),
    # a little over the target is still within reach (the ITL is over-predicted near the
    # knee): the least cost first
    ({"a": 1.2, "b": 3.0, "c": 1.8}, ["a", "c", "b"]),
    ({"a": OUT_OF_REACH, "b": 3.0}, ["a", "b"]),
    # out of reach everywhere: the replica already worst off first, so the others keep
    # their streams within the SLO
    ({"a": 1.6, "b": 3.0, "c": 1.8}, ["b", "c", "a"]),
    ({}, []),
]


@pytest.mark.parametrize(("costs", "order"), SCORES_TABLE)
def test_a_request_no_replica_keeps_within_the_slo_goes_to_the_worst_off(
    costs: dict[str, float], order: list[str]
) -> None:
    scores = slo_scores(costs)
    assert sorted(scores, key=lambda u: -scores[u]) == order
    assert all(0.0 < v < 1.0 for v in scores.values())


# (seconds since the first prompt ahead began, prompt tokens still ahead): two prompts of
# 4,000 tokens sent at 0 to an idle H100; it computes 8,192 per step of 7 ms + 262 ms
PER_STEP = 8192 / (0.007 + 80e-6 * 2 + 8192 * 32e-6)
DRAIN_TABLE = [
    (0.0, 8000),
    (0.1, 8000 - int(0.1 * PER_STEP)),
    (1.0, 0),  # all computed by now (their first tokens are late to arrive)
]


@pytest.mark.parametrize(("elapsed", "ahead"), DRAIN_TABLE)
def test_the_prefill_ahead_drains_while_the_replica_computes_it(elapsed: float, ahead: int) -> None:
    now = [0.0]
    predictions = Predictions(clock=lambda: now[0])
    request = RoutingRequest(model="m", prompt_chars=16_000)
    a = Candidate(url="http://a", in_flight=2)
    first = predictions.sent("http://a", request, a)
    predictions.sent("http://a", request, a)
    now[0] = elapsed
    assert predictions.dispatch("http://a", request, a).ahead_tokens == ahead
    # the first one's first token: the second's prefill goes on from there
    predictions.started("http://a", first)
    assert predictions.dispatch("http://a", request, a).ahead_tokens == 4000


@pytest.mark.parametrize("figure", [math.nan, -3.0, math.inf, -math.inf, 1e300])
def test_no_engine_figure_makes_the_model_raise(figure: float) -> None:
    """The scrape parser refuses these; the model itself never raises on them either."""
    now = [0.0]
    predictions = Predictions(clock=lambda: now[0])
    request = RoutingRequest(model="m", prompt_chars=4000)
    a = Candidate(url="http://a", in_flight=2, running=figure, waiting=figure)
    predictions.sent("http://a", request, a)  # a prompt ahead: it drains at the batch's pace
    now[0] = 0.5
    costs = predictions.costs(request, [a], 2.0, 0.1)
    assert all(math.isfinite(v) for v in costs["http://a"])
    assert predictions.dispatch("http://a", request, a).batch == 3.0


def test_a_stream_that_breaks_after_its_first_token_teaches_no_fast_ttft() -> None:
    """Its instant first token is taken back, and the break counts as a late answer: the
    replica never looks faster than before for it (a whole answer's TTFT is kept)."""
    predictions = Predictions()
    request = RoutingRequest(model="m", prompt_chars=4000)
    a = Candidate(url="http://a")
    before = predictions.model.predict("http://a", predictions.dispatch("http://a", request, a))
    for _ in range(20):
        dispatch = predictions.sent("http://a", request, a)
        learnt = predictions.started("http://a", dispatch, 1e-4)
        assert learnt is not None and learnt[0] + learnt[1] < 0  # it did look fast
        predictions.broken("http://a", dispatch, learnt)
    after = predictions.model.predict("http://a", predictions.dispatch("http://a", request, a))
    assert after[0] > before[0]
    dispatch = predictions.sent("http://a", request, a)
    predictions.started("http://a", dispatch, 1e-4)  # a whole answer: kept
    predictions.answered(("m", "m", "ns"), "http://a", dispatch, 1e-4, None)
    assert (
        predictions.model.predict("http://a", predictions.dispatch("http://a", request, a))[0]
        < after[0]
    )


def test_a_full_replica_predicts_the_wait_for_a_slot() -> None:
    """A replica held at its concurrency limit (16 running and a queue, two scrapes in a
    row) starts a new request only when answers there end: its TTFT is that wait, not a
    step or two (before: 20-70 ms predicted for 1.2-1.9 s observed, and slo-aware herded
    onto the faster replicas)."""
    now = [0.0]
    predictions = Predictions(clock=lambda: now[0])
    request = RoutingRequest(model="m", prompt_chars=400)
    full = Candidate(url="http://a", in_flight=20, running=16.0, waiting=4.0)
    free = Candidate(url="http://a", in_flight=10, running=10.0, waiting=0.0)
    assert predictions.dispatch("http://a", request, full).queued == 0.0  # not yet known
    now[0] = 2.0
    queued = predictions.dispatch("http://a", request, full)
    assert (queued.slots, queued.queued, queued.batch) == (16.0, 5.0, 16.0)
    ttft_full = predictions.model.predict("http://a", queued)[0]
    ttft_free = predictions.model.predict(
        "http://a", predictions.dispatch("http://a", request, free)
    )[0]
    step = H100.step_base_s + H100.decode_token_s * 16
    # 5 answers must end; one of 16 answers of ~150 tokens ends every 150 / 16 steps
    assert ttft_full - ttft_free >= 0.9 * 5 * 150 / 16 * step
    # running more than that: the limit is unknown again
    more = Candidate(url="http://a", in_flight=20, running=17.0, waiting=0.0)
    assert predictions.dispatch("http://a", request, more).queued == 0.0


# (running, waiting) of successive scrapes 1 s apart -> the limit learnt at the end
SLOTS_TABLE = [
    ([(16, 2), (16, 3), (16, 1)], 16.0),  # held at 16 with a queue
    ([(16, 2)], 0.0),  # once: a prompt may be waiting for a step's token budget
    ([(12, 0), (5, 1), (5, 1), (5, 1)], 0.0),  # a queue under the most it ran
    ([(14, 1), (15, 1), (16, 1)], 0.0),  # a count that moves
    ([(16, 1), (16, 0), (16, 1)], 0.0),  # the queue cleared in between
]


@pytest.mark.parametrize(("scrapes", "limit"), SLOTS_TABLE)
def test_the_concurrency_limit_is_a_count_held_with_a_queue(
    scrapes: list[tuple[int, int]], limit: float
) -> None:
    now = [0.0]
    predictions = Predictions(clock=lambda: now[0])
    request = RoutingRequest(model="m", prompt_chars=400)
    slots = 0.0
    for running, waiting in scrapes:
        c = Candidate(url="http://a", in_flight=running + waiting, running=running, waiting=waiting)
        slots = predictions.dispatch("http://a", request, c).slots
        now[0] += 1.0
    assert slots == limit
