# ruff: noqa: E501  (the table reads best one row per line)
"""Table tests of the default scaling policy (`kv-queue`): every rule, one row or sequence each."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from kubellm.autoscaler import policy as p
from kubellm.autoscaler.kvqueue import KVQueuePolicy

from kubellm import api

NOW = 1_800_000_000.0
POLICY = KVQueuePolicy()


def spec(**fields: object) -> api.Autoscaling:
    return api.Autoscaling(**fields)


def rep(
    waiting: float = 0, running: float = 0, kv: float = 0.0, fresh: bool = True
) -> p.ReplicaMetrics:
    return p.ReplicaMetrics(
        name="r", fresh=fresh, waiting=waiting, running=running, kv_cache_usage=kv
    )


def obs(
    current: int,
    *replicas: p.ReplicaMetrics,
    pending: float | None = 0,
    now: float = NOW,
    rate: float | None = None,
    recent: float | None = None,
) -> p.Observation:
    return p.Observation(
        now=now,
        current_replicas=current,
        replicas=replicas,
        gateway_pending=pending,
        request_rate=rate,
        recent_request_rate=recent if recent is not None else rate,
    )


IDLE = rep(0, 0, 0.0)
BUSY = rep(waiting=0, running=8, kv=0.8)  # exactly on the KV target
DOWN_NOW = {"scale_down_stabilization_seconds": 0}  # single-decision rows that may scale down
ZERO_OK = {"min_replicas": 0, "scale_to_zero": True, "idle_seconds_before_zero": 600}
RATE = {"target_requests_per_replica": 5, "max_replicas": 6}  # the rate signal on

# (id, observation, state, spec fields, expected replicas, expected reason)
ROWS = [
    # signals
    ("queue asks more", obs(2, rep(10, 8, 0.5), rep(10, 8, 0.5)), None, {"max_replicas": 9}, 5, p.QUEUE_DEPTH),
    ("kv asks more", obs(2, rep(0, 8, 1.0), rep(0, 8, 1.0)), None, {}, 3, p.KV_CACHE_USAGE),
    ("largest signal wins", obs(1, rep(10, 8, 1.0)), None, {"max_replicas": 9}, 3, p.QUEUE_DEPTH),
    ("within tolerance holds", obs(2, rep(0, 8, 0.85), rep(0, 8, 0.85)), None, DOWN_NOW, 2, p.STEADY),
    ("on target holds", obs(3, BUSY, BUSY, BUSY), None, DOWN_NOW, 3, p.STEADY),
    # clamps
    ("clamped to max", obs(2, rep(40, 8, 1.0), rep(40, 8, 1.0)), None, {"max_replicas": 4}, 4, p.MAX_REPLICAS),
    ("at max stays", obs(4, *[rep(40, 8, 1.0)] * 4), None, {"max_replicas": 4}, 4, p.MAX_REPLICAS),
    ("max lowered below current", obs(6, *[BUSY] * 6), None, {"max_replicas": 3}, 3, p.MAX_REPLICAS),
    ("raised to min", obs(1, IDLE), None, {"min_replicas": 2, "max_replicas": 5}, 2, p.MIN_REPLICAS),
    ("at min stays", obs(2, IDLE, IDLE), None, {"min_replicas": 2, **DOWN_NOW}, 2, p.MIN_REPLICAS),
    # step bounds
    ("up step: +4 pods", obs(1, rep(40, 8, 1.0)), None, {"max_replicas": 20}, 5, p.QUEUE_DEPTH),
    ("up step: +100%", obs(8, *[rep(10, 8, 1.0)] * 8), None, {"max_replicas": 30}, 16, p.QUEUE_DEPTH),
    ("down step: -50%", obs(10, *[IDLE] * 10), None, {"max_replicas": 10, **DOWN_NOW}, 5, p.LOW_LOAD),
    ("down step: -1 pod", obs(2, IDLE, IDLE), None, DOWN_NOW, 1, p.LOW_LOAD),
    # replicas still starting count as coming capacity
    ("starting absorb the queue", obs(4, rep(40, 8, 1.0)), None, {"max_replicas": 10}, 4, p.STEADY),
    ("starting, queue beyond them", obs(2, rep(40, 8, 1.0)), None, {"max_replicas": 10}, 6, p.QUEUE_DEPTH),
    ("none ready yet: hold", obs(3), None, DOWN_NOW, 3, p.REPLICAS_STARTING),
    # stale or missing metrics never scale down
    ("one stale: no scale-down", obs(3, IDLE, IDLE, rep(fresh=False)), None, DOWN_NOW, 3, p.STALE_METRICS),
    ("all stale: hold", obs(2, rep(fresh=False), rep(fresh=False)), None, DOWN_NOW, 2, p.STALE_METRICS),
    ("stale, fresh overloaded: up", obs(2, rep(20, 8, 1.0), rep(fresh=False)), None, {"max_replicas": 9}, 5, p.QUEUE_DEPTH),
    # scale to zero and wake-up
    ("wake up on pending", obs(0, pending=3), None, ZERO_OK, 1, p.GATEWAY_PENDING),
    ("zero, no demand: stay", obs(0, pending=0), None, ZERO_OK, 0, p.STEADY),
    ("zero, gateway unknown: stay", obs(0, pending=None), None, ZERO_OK, 0, p.STEADY),
    ("zero without scaleToZero: up to 1", obs(0), None, {"min_replicas": 0}, 1, p.MIN_REPLICAS),
    ("idle, zero not allowed", obs(1, IDLE), None, {"min_replicas": 0, **DOWN_NOW}, 1, p.MIN_REPLICAS),
    ("idle too briefly", obs(1, IDLE), p.PolicyState((), NOW - 100), {**ZERO_OK, **DOWN_NOW}, 1, p.MIN_REPLICAS),
    ("idle long enough: zero", obs(1, IDLE), p.PolicyState((), NOW - 600), {**ZERO_OK, **DOWN_NOW}, 0, p.IDLE),
    ("pending keeps one", obs(1, IDLE, pending=2), p.PolicyState((), NOW - 900), {**ZERO_OK, **DOWN_NOW}, 1, p.GATEWAY_PENDING),
    ("gateway unknown keeps one", obs(1, IDLE, pending=None), p.PolicyState((), NOW - 900), {**ZERO_OK, **DOWN_NOW}, 1, p.MIN_REPLICAS),
    ("running keeps one", obs(1, rep(0, 1, 0.1)), p.PolicyState((), NOW - 900), {**ZERO_OK, **DOWN_NOW}, 1, p.STEADY),
    ("stale keeps one", obs(1, rep(fresh=False)), p.PolicyState((), NOW - 900), {**ZERO_OK, **DOWN_NOW}, 1, p.STALE_METRICS),
    ("zero needs the window too", obs(1, IDLE), p.PolicyState((), NOW - 900), ZERO_OK, 1, p.SCALE_DOWN_STABILIZING),
    # request rate (where targetRequestsPerReplica is set); the queue then asks at most for
    # the arrivals plus draining its backlog in DRAIN_SECONDS: ceil((12 + 400 / 60) / 5) = 4
    ("rate asks more", obs(1, rep(0, 20, 0.1), rate=20), None, RATE, 4, p.REQUEST_RATE),
    ("rate off without its target", obs(1, rep(0, 20, 0.1), rate=20), None, {}, 1, p.STEADY),
    ("rate unknown: other signals", obs(1, rep(0, 20, 0.1), rate=None), None, RATE, 1, p.STEADY),
    ("rate holds a light fleet", obs(8, *[rep(0, 10, 0.05)] * 8, rate=25), None, {**RATE, **DOWN_NOW}, 5, p.LOW_LOAD),
    ("rate within tolerance holds", obs(4, *[rep(0, 10, 0.05)] * 4, rate=21), None, {**RATE, **DOWN_NOW}, 4, p.STEADY),
    ("a step: the last period's rate", obs(1, rep(10, 120, 0.7), rate=8, recent=24), None, RATE, 5, p.REQUEST_RATE),
    ("rate bounds the queue's ask", obs(2, rep(200, 120, 0.9), rep(200, 120, 0.9), rate=12), None, RATE, 4, p.QUEUE_DEPTH),
    ("rate clamped to max", obs(2, rep(0, 10, 0.1), rep(0, 10, 0.1), rate=100), None, RATE, 6, p.MAX_REPLICAS),
    # replicas still starting are never removed
    ("starting: no scale-down", obs(4, IDLE, IDLE), None, DOWN_NOW, 4, p.REPLICAS_STARTING),
    ("starting: rate falls, hold", obs(6, *[rep(0, 5, 0.05)] * 3, rate=5), None, {**RATE, **DOWN_NOW}, 6, p.REPLICAS_STARTING),
]  # fmt: skip


@pytest.mark.parametrize(
    ("observation", "state", "fields", "replicas", "reason"),
    [row[1:] for row in ROWS],
    ids=[row[0] for row in ROWS],
)
def test_single_decision(
    observation: p.Observation,
    state: p.PolicyState | None,
    fields: dict[str, object],
    replicas: int,
    reason: str,
) -> None:
    decision = POLICY.decide(observation, state or p.PolicyState(), spec(**fields))
    assert (decision.replicas, decision.reason) == (replicas, reason), decision.message


def test_message_explains_the_figures() -> None:
    decision = POLICY.decide(
        obs(2, rep(10, 8, 0.5), rep(10, 8, 0.5)), p.PolicyState(), spec(max_replicas=9)
    )
    assert decision.message.startswith("QueueDepth: 2 -> 5 replicas")
    assert "queue 20 waiting on 2 ready" in decision.message
    assert "KV cache mean 0.50" in decision.message
    assert decision.kv_cache_usage == pytest.approx(0.5)
    assert decision.queue_depth == pytest.approx(10)


def test_message_explains_the_rate() -> None:
    decision = POLICY.decide(
        obs(1, rep(0, 20, 0.1), rate=14.5, recent=20), p.PolicyState(), spec(**RATE)
    )
    assert decision.message.startswith("RequestRate: 1 -> 4 replicas; queue 0 waiting on 1 ready")
    assert "rate 20.0 req/s (target 5/replica) asks 4" in decision.message


def test_rate_keeps_the_fleet_after_the_window_where_kv_and_queue_read_near_zero() -> None:
    # Eight replicas carrying 2.4 replicas' worth: KV and queue ask for one replica, the rate
    # for three. Without the rate the fleet collapses after the window; with it, it stops at 3.
    light = rep(0, 12, 0.08)
    loads = every(5, 900, light)
    without = run(loads, {"max_replicas": 8, "scale_down_stabilization_seconds": 300}, start=8)
    with_rate = run_rate(
        loads, 12.0, {"max_replicas": 8, "target_requests_per_replica": 5}, start=8
    )
    assert without[-1][1] == 1
    assert with_rate[-1][1] == 3 and min(r for _, r, _ in with_rate) == 3


def test_step_limit_is_reported() -> None:
    decision = POLICY.decide(obs(1, rep(40, 8, 1.0)), p.PolicyState(), spec(max_replicas=20))
    assert "step-limited" in decision.message


# --------------------------------------------------------------------------- sequences


def run(
    loads: list[tuple[float, p.ReplicaMetrics]],
    fields: dict[str, object],
    start: int,
    *,
    restart_each_step: bool = False,
    pending: float | None = 0,
) -> list[tuple[float, int, str]]:
    """Feed (time offset, per-replica load) to the policy; replicas follow decisions at once."""
    autoscaling = spec(**fields)
    state, current, out = p.PolicyState(), start, []
    for offset, load in loads:
        decision = POLICY.decide(
            obs(current, *[load] * current, pending=pending, now=NOW + offset), state, autoscaling
        )
        state = decision.state
        if restart_each_step:  # what a restarted loop reads back from status.autoscaler
            state = p.PolicyState.from_status(state.to_status())
        current = decision.replicas
        out.append((offset, current, decision.reason))
    return out


def run_rate(
    loads: list[tuple[float, p.ReplicaMetrics]], rate: float, fields: dict[str, object], start: int
) -> list[tuple[float, int, str]]:
    """Like `run`, with a constant request rate at the gateway."""
    autoscaling = spec(**fields)
    state, current, out = p.PolicyState(), start, []
    for offset, load in loads:
        observation = obs(current, *[load] * current, now=NOW + offset, rate=rate)
        decision = POLICY.decide(observation, state, autoscaling)
        state, current = decision.state, decision.replicas
        out.append((offset, current, decision.reason))
    return out


def every(
    seconds: float, until: float, load: p.ReplicaMetrics, start: float = 0
) -> list[tuple[float, p.ReplicaMetrics]]:
    return [(start + i * seconds, load) for i in range(int((until - start) / seconds))]


def test_scale_down_waits_for_the_whole_window() -> None:
    loads = [(0.0, BUSY), *every(5, 600, IDLE, start=5)]
    trace = run(loads, {"scale_down_stabilization_seconds": 300}, start=4)
    first_down = next(t for t, replicas, _ in trace if replicas < 4)
    assert first_down == 300  # the last high recommendation (t=0) left the window
    assert [r for t, r, _ in trace if t < first_down] == [4] * len(
        [t for t, _, _ in trace if t < first_down]
    )
    assert {reason for t, _, reason in trace if 0 < t < first_down} == {p.SCALE_DOWN_STABILIZING}


def test_one_busy_period_restarts_the_window() -> None:
    loads = [*every(5, 200, IDLE), (200.0, BUSY), *every(5, 700, IDLE, start=205)]
    trace = run(loads, {"scale_down_stabilization_seconds": 300}, start=4)
    assert next(t for t, replicas, _ in trace if replicas < 4) == 500


def test_fresh_state_never_scales_down_at_once() -> None:
    trace = run(every(5, 100, IDLE), {"scale_down_stabilization_seconds": 60}, start=3)
    assert (
        next(t for t, replicas, _ in trace if replicas < 3) == 60
    )  # the seeded "3" left the window


def test_scale_up_stabilisation_needs_sustained_load() -> None:
    fields = {"scale_up_stabilization_seconds": 30, "max_replicas": 8}
    blip = run([(0.0, rep(20, 8, 1.0)), *every(5, 100, BUSY, start=5)], fields, start=2)
    assert {replicas for _, replicas, _ in blip} == {2}
    sustained = run(every(5, 100, rep(20, 8, 1.0)), fields, start=2)
    first_up = next(t for t, replicas, _ in sustained if replicas > 2)
    assert first_up == 30
    assert {reason for t, _, reason in sustained if t < first_up} == {p.SCALE_UP_STABILIZING}


def test_scale_up_is_immediate_by_default() -> None:
    trace = run(every(5, 10, rep(20, 8, 1.0)), {"max_replicas": 8}, start=2)
    assert trace[0][1] > 2


def test_oscillating_load_does_not_flap() -> None:
    # 20 s busy, 20 s idle, for 30 minutes: at most one change of direction per window.
    window = 300
    loads = [(t, rep(12, 8, 1.0) if (t // 20) % 2 == 0 else IDLE) for t in range(0, 1800, 5)]
    trace = run(loads, {"scale_down_stabilization_seconds": window, "max_replicas": 8}, start=1)
    changes = []
    previous, direction = trace[0][1], 0
    for t, replicas, _ in trace[1:]:
        step = (replicas > previous) - (replicas < previous)
        if step and direction and step != direction:
            changes.append(t)
        direction, previous = step or direction, replicas
    for t in changes:
        assert len([c for c in changes if t - window < c <= t]) <= 1


def test_state_survives_a_restart_through_status() -> None:
    loads = [(0.0, BUSY), *every(5, 400, IDLE, start=5), *every(5, 450, rep(20, 8, 1.0), start=400)]
    fields = {"scale_down_stabilization_seconds": 120, **ZERO_OK}
    in_memory = run(loads, fields, start=4)
    restarted = run(loads, fields, start=4, restart_each_step=True)
    assert restarted == in_memory


def test_scale_to_zero_after_idle_and_wake_up() -> None:
    fields = {**ZERO_OK, "scale_down_stabilization_seconds": 60, "idle_seconds_before_zero": 120}
    trace = run(every(5, 400, IDLE), fields, start=2)
    zero_at = next(t for t, replicas, _ in trace if replicas == 0)
    assert zero_at >= 120
    assert trace[-1][1] == 0
    woke = POLICY.decide(obs(0, pending=1, now=NOW + 400), p.PolicyState(), spec(**fields))
    assert (woke.replicas, woke.reason) == (1, p.GATEWAY_PENDING)


def test_history_stays_small() -> None:
    autoscaling = spec()
    state = p.PolicyState()
    for i in range(1000):
        state = POLICY.decide(obs(3, BUSY, BUSY, BUSY, now=NOW + 5 * i), state, autoscaling).state
    assert len(state.recommendations) <= 2


def test_status_round_trip_and_bad_entries() -> None:
    state = p.PolicyState(((NOW, 3), (NOW + 5.5, 2)), NOW - 10)
    status = state.to_status()
    assert status["recommendations"][0] == {"time": p.format_time(NOW), "replicas": 3}
    assert p.PolicyState.from_status(status) == state
    odd = {
        "recommendations": [{"time": "yesterday", "replicas": 1}, {"replicas": 2}],
        "idleSince": "x",
    }
    assert p.PolicyState.from_status(odd) == p.PolicyState()
    assert p.PolicyState.from_status(None) == p.PolicyState()


# --------------------------------------------------------------------------- registry


def test_registry() -> None:
    assert {"kv-queue", "concurrency"} <= set(p.names())
    assert isinstance(p.get(), KVQueuePolicy)
    with pytest.raises(ValueError, match="unknown autoscaling policy 'nope'"):
        p.get("nope")
    observation = obs(2, rep(10, 8, 0.5), rep(10, 8, 0.5))
    assert p.decide(observation, p.PolicyState(), spec()) == POLICY.decide(
        observation, p.PolicyState(), spec()
    )


@pytest.fixture
def registry() -> Iterator[None]:
    """The policy registry as it was before the test: policies a test registers go."""
    before = set(p.names())
    yield
    for name in set(p.names()) - before:
        p.unregister(name)


def test_register_a_policy(registry: None) -> None:
    @p.register("fixed-test")
    @dataclasses.dataclass(frozen=True)
    class Fixed:
        def decide(
            self, observation: p.Observation, state: p.PolicyState, spec: api.Autoscaling
        ) -> p.Decision:
            return p.Decision(spec.max_replicas, p.MAX_REPLICAS)

    assert p.get("fixed-test").decide(obs(1), p.PolicyState(), spec(max_replicas=3)).replicas == 3
    p.unregister("fixed-test")
    with pytest.raises(ValueError, match="unknown autoscaling policy 'fixed-test'"):
        p.get("fixed-test")


def test_concurrency_policy() -> None:
    kpa = p.get("concurrency")
    up = kpa.decide(obs(1, rep(8, 16, 1.0)), p.PolicyState(), spec(max_replicas=8))
    assert (up.replicas, up.reason) == (3, p.CONCURRENCY)
    held = kpa.decide(obs(3, IDLE, IDLE, IDLE, now=NOW + 5), up.state, spec(max_replicas=8))
    assert held.replicas == 3  # the busy recommendation is still in the stable window
    later = kpa.decide(obs(3, IDLE, IDLE, IDLE, now=NOW + 65), held.state, spec(max_replicas=8))
    assert (later.replicas, later.reason) == (1, p.LOW_LOAD)


# ---------------------------------------------------------------- the derived per-replica rate


def test_learns_what_a_replica_serves_while_every_replica_is_saturated() -> None:
    saturated = dataclasses.replace(
        obs(2, rep(6, 120, 0.9), rep(5, 120, 0.9), rate=20), replica_answer_rate=16.0
    )
    first = POLICY.decide(saturated, p.PolicyState(), spec(max_replicas=8))
    # saturation just began: answers still lag the load, nothing learned; the queue adds
    # one replica, not a guess at the load
    assert first.state.saturated_since == NOW and first.state.learned_rate is None
    assert first.replicas == 3
    state = p.PolicyState(saturated_since=NOW - 30)  # saturated for 30 s
    decision = POLICY.decide(saturated, state, spec(max_replicas=8))
    assert decision.state.learned_rate == pytest.approx(8.0)  # 16 answered/s over 2 replicas
    # the rate signal then asks ceil(20 / (0.8 x 8)) = 4
    assert decision.replicas == 4 and "target derived 6.4/replica" in decision.message

    # a moving average: a later saturated period at 10/replica moves it a fifth of the way
    later = dataclasses.replace(saturated, now=NOW + 5, replica_answer_rate=20.0)
    again = POLICY.decide(later, decision.state, spec(max_replicas=8))
    assert again.state.learned_rate == pytest.approx(8.0 + 0.2 * (10.0 - 8.0))


@pytest.mark.parametrize(
    "observation",
    [
        obs(2, rep(6, 120, 0.9), rep(1, 90, 0.6), rate=20),  # one replica under its queue target
        obs(2, rep(6, 120, 0.9), rep(fresh=False), rate=20),  # one replica's load unknown
    ],
    ids=["not every replica saturated", "stale metrics"],
)
def test_answers_of_a_fleet_not_saturated_teach_nothing(observation: p.Observation) -> None:
    observation = dataclasses.replace(observation, replica_answer_rate=9.0)
    state = p.PolicyState(learned_rate=7.5, saturated_since=NOW - 60)
    decision = POLICY.decide(observation, state, spec(max_replicas=8))
    assert decision.state.learned_rate == 7.5 and decision.state.saturated_since is None


def test_the_spec_rate_wins_over_the_learned_one() -> None:
    light = obs(4, *[rep(0, 10, 0.05)] * 4, rate=21)
    state = p.PolicyState(learned_rate=100.0)  # would ask for one replica
    decision = POLICY.decide(light, state, spec(**RATE, **DOWN_NOW))
    assert decision.replicas == 4 and "target 5/replica" in decision.message


def test_the_learned_rate_survives_a_restart_through_the_status() -> None:
    status = p.PolicyState((), None, 7.25, NOW).to_status()
    assert status["learnedRequestsPerReplica"] == 7.25
    assert p.PolicyState.from_status(status) == p.PolicyState((), None, 7.25, NOW)
    for odd in ("x", -1, 0, float("inf"), None):
        assert p.PolicyState.from_status({"learnedRequestsPerReplica": odd}).learned_rate is None


# ---------------------------------------------------------------- the fallback takes spikes

FALLBACK_SPEC = {"max_replicas": 8, "max_fallback_share": 0.05, "target_requests_per_replica": 5}
# The rate asks ceil(30 / 5) = 6; the queue (2 per replica) is under its target.
RISING = obs(2, rep(2, 120, 0.9), rep(2, 120, 0.9), rate=30)


@pytest.mark.parametrize(
    ("share", "replicas", "reason"),
    [
        (0.03, 2, p.FALLBACK_ABSORBING),  # a spike the fallback absorbs: no replica added
        (0.05, 2, p.FALLBACK_ABSORBING),  # at the knob: still absorbed
        (0.20, 6, p.REQUEST_RATE),  # sustained overflow: the signals speak
        (None, 6, p.REQUEST_RATE),  # no fallback (or the gateway unknown): as without one
    ],
)
def test_load_adds_replicas_only_once_the_fallback_share_passes_the_knob(
    share: float | None, replicas: int, reason: str
) -> None:
    rising = dataclasses.replace(RISING, fallback_share=share)
    decision = POLICY.decide(rising, p.PolicyState(), spec(**FALLBACK_SPEC))
    assert (decision.replicas, decision.reason) == (replicas, reason), decision.message
    if share is not None:
        assert f"fallback took {share:.1%} of requests" in decision.message


def test_a_queue_past_its_target_is_not_absorbed() -> None:
    # requests wait at the replicas, not at the fallback: the queue's ask stands
    queued = dataclasses.replace(
        obs(2, rep(10, 120, 0.9), rep(10, 120, 0.9), rate=30), fallback_share=0.01
    )
    decision = POLICY.decide(queued, p.PolicyState(), spec(**FALLBACK_SPEC))
    assert (decision.replicas, decision.reason) == (5, p.QUEUE_DEPTH), decision.message


def test_a_zero_share_scales_up_on_any_overflow() -> None:
    rising = dataclasses.replace(RISING, fallback_share=0.01)
    decision = POLICY.decide(
        rising, p.PolicyState(), spec(**{**FALLBACK_SPEC, "max_fallback_share": 0})
    )
    assert decision.replicas == 6


def test_the_fallback_never_holds_the_floors_or_scale_down() -> None:
    # wake-up from zero and minReplicas are not load: the fallback share does not hold them
    wake = dataclasses.replace(obs(0, pending=3), fallback_share=0.0)
    assert POLICY.decide(wake, p.PolicyState(), spec(**ZERO_OK)).replicas == 1
    low = dataclasses.replace(obs(1, IDLE), fallback_share=0.0)
    assert POLICY.decide(low, p.PolicyState(), spec(min_replicas=3, max_replicas=5)).replicas == 3
    # and scale-down goes on as without a fallback
    light = dataclasses.replace(obs(4, *[IDLE] * 4), fallback_share=0.0)
    assert POLICY.decide(light, p.PolicyState(), spec(**DOWN_NOW)).replicas == 2


def _run_every_period(
    fallback_share: float | None, recent_at: dict[float, float], until: float, current: int
) -> list[tuple[float, int]]:
    """(time, replicas) every 5 s at a 30 s rate of 14 req/s (3 replicas' worth at 5/replica),
    the last period's rate 14 except where `recent_at` says otherwise."""
    state, seen = p.PolicyState(), []
    for k in range(int(until // 5) + 1):
        t = 5.0 * k
        observed = dataclasses.replace(
            obs(current, *[rep(0, 60, 0.5)] * current, now=NOW + t, rate=14,
                recent=recent_at.get(t, 14)),
            fallback_share=fallback_share,
        )  # fmt: skip
        decision = POLICY.decide(observed, state, spec(**FALLBACK_SPEC))
        state, current = decision.state, decision.replicas
        seen.append((t, current))
    return seen


@pytest.mark.parametrize(("fallback_share", "down_at"), [(0.0, 300.0), (None, 450.0)])
def test_with_a_fallback_a_noisy_period_is_not_held_for_the_scale_down_window(
    fallback_share: float | None, down_at: float
) -> None:
    # four replicas carrying three's worth; one period's rate reads 19 (asks 4) at t=150.
    # With a fallback the window remembers the 30 s rate's ask: down after the 300 s window
    # from the start. Without one the noisy period holds 4 until 300 s after it.
    seen = _run_every_period(fallback_share, {150.0: 19}, 470.0, current=4)
    first_down = next(t for t, replicas in seen if replicas < 4)
    assert first_down == down_at
    assert {r for _, r in seen} == {4, 3}


def test_with_a_fallback_the_last_periods_rate_still_scales_up_at_once_and_is_held() -> None:
    # a step the fallback cannot absorb (its share past the knob): 3 -> 4 in the period it
    # shows, and the scale-up is remembered for the window, not dropped the next period
    seen = _run_every_period(0.5, {5.0: 19}, 300.0, current=3)
    assert seen[1] == (5.0, 4)
    assert all(replicas == 4 for t, replicas in seen if t >= 5)


# ---------------------------------------------------------------- the cost rule (fallbackCostRatio)

from kubellm.autoscaler import kvqueue  # noqa: E402

# ratio 6: the fallback charges six times a replica's price for its load; 60 s model loads.
# The hold: min(300, 60 x 7) = 300 s; the overflow waits (6 x 60 + 300) / 5 = 132 s.
COST_SPEC = {**FALLBACK_SPEC, "fallback_cost_ratio": 6.0, "model_load_seconds": 60}


def test_the_cost_rules_waits_are_rent_or_buy() -> None:
    assert kvqueue.scale_down_hold(6.0, 60, 300) == 300  # a mistake costs more than the window
    assert kvqueue.scale_down_hold(1.0, 60, 300) == 120  # cheap API: a shorter hold
    assert kvqueue.overflow_wait(6.0, 60, 300) == pytest.approx(132.0)
    assert kvqueue.overflow_wait(12.0, 60, 300) < kvqueue.overflow_wait(6.0, 60, 300)
    assert kvqueue.overflow_wait(1.0, 60, 120) == float("inf")  # never dearer at the API


def _overflowing(
    times: list[float], share: float = 0.5, refused_at: float | None = None, **fields: object
) -> list[p.Decision]:
    """RISING (2 replicas, the rate asks 6, the share far past the knob) every period."""
    state, out = p.PolicyState(), []
    for t in times:
        observed = dataclasses.replace(
            RISING, now=NOW + t, fallback_share=share, refused=3 if t == refused_at else 0
        )
        decision = POLICY.decide(observed, state, spec(**{**COST_SPEC, **fields}))
        state = decision.state
        out.append(decision)
    return out


def test_with_the_cost_rule_an_overflow_waits_at_the_fallback_until_replicas_pay() -> None:
    times = [5.0 * k for k in range(30)]  # 0 .. 145 s
    decisions = _overflowing(times)
    absorbed = [t for t, d in zip(times, decisions, strict=True) if d.replicas == 2]
    assert absorbed == [t for t in times if t < 132]  # the share alone would add at once
    assert all(d.reason == p.FALLBACK_ABSORBING for d in decisions if d.replicas == 2)
    assert decisions[-1].replicas == 6 and decisions[-1].reason == p.REQUEST_RATE
    assert decisions[0].state.to_status()["overflowSince"] == p.format_time(NOW)


def test_a_refusal_ends_the_wait_at_once() -> None:
    decisions = _overflowing([0.0, 5.0, 10.0], refused_at=10.0)
    assert [d.replicas for d in decisions] == [2, 2, 6]


def test_without_the_ratio_the_share_rule_decides_as_before() -> None:
    decisions = _overflowing([0.0], fallback_cost_ratio=None)
    assert decisions[0].replicas == 6


def test_an_overflow_that_ends_starts_its_wait_afresh() -> None:
    state = p.PolicyState()
    calm = obs(2, rep(0, 40, 0.5), rep(0, 40, 0.5), rate=8)  # rate and KV ask 2: no overflow
    for t, seen in (
        (0.0, RISING),
        (100.0, RISING),
        (105.0, calm),
        (110.0, RISING),
        (200.0, RISING),
    ):
        observed = dataclasses.replace(seen, now=NOW + t, fallback_share=0.5)
        decision = POLICY.decide(observed, state, spec(**COST_SPEC))
        state = decision.state
    assert decision.replicas == 2  # 90 s since the overflow came back: still absorbed


def test_with_a_cheap_api_the_scale_down_waits_the_shorter_hold() -> None:
    # ratio 1: hold min(300, 60 x 2) = 120 s. Four replicas, then three replicas' worth.
    cheap = {**COST_SPEC, "fallback_cost_ratio": 1.0}
    state, current, first_down = p.PolicyState(((NOW, 4),)), 4, None
    for k in range(1, 80):
        t = 5.0 * k
        observed = dataclasses.replace(
            obs(current, *[rep(0, 60, 0.5)] * current, now=NOW + t, rate=14), fallback_share=0.0
        )
        decision = POLICY.decide(observed, state, spec(**cheap))
        state, current = decision.state, decision.replicas
        if current < 4 and first_down is None:
            first_down = t
    assert first_down == 120.0


@pytest.mark.parametrize(("in_flight", "replicas"), [(31, 2), (32, 6), (None, 2)])
def test_a_fallback_half_full_ends_the_wait(in_flight: float | None, replicas: int) -> None:
    # past half of maxConcurrency a growing overflow would soon queue or be refused
    observed = dataclasses.replace(
        RISING, fallback_share=0.5, refused=0, fallback_in_flight=in_flight, fallback_capacity=64
    )
    decision = POLICY.decide(observed, p.PolicyState(), spec(**COST_SPEC))
    assert decision.replicas == replicas, decision.message


# ---------------------------------------------------------------- the trend forecast (predictive)


def _ramp_history(now: float, start_rate: float, slope: float, span: float = 300.0):
    """(time, admitted so far) every 5 s of a noiseless ramp ending at `now`."""
    out, t0 = [], now - span
    for k in range(int(span // 5) + 1):
        t = t0 + 5.0 * k
        out.append((t, start_rate * (t - t0) + slope * (t - t0) ** 2 / 2))
    return tuple(out)


PREDICT_SPEC = {"target_requests_per_replica": 5, "max_replicas": 8, "model_load_seconds": 60}
# 5 -> 20 req/s over 300 s (0.05 req/s per s): 18.5 req/s over the last 30 s asks 4 replicas;
# in 60 s the load is 23 req/s: 5 replicas.
RAMP = dataclasses.replace(
    obs(4, *[rep(0, 20, 0.5)] * 4, rate=18.5),
    admitted_history=_ramp_history(NOW, 5.0, 0.05),
)


def test_predictive_asks_for_the_load_one_model_load_ahead() -> None:
    decision = POLICY.decide(RAMP, p.PolicyState(), spec(**PREDICT_SPEC, predictive=True))
    assert (decision.replicas, decision.reason) == (5, p.FORECAST), decision.message
    assert "rate trend: 23.0 req/s in 60 s asks 5" in decision.message
    # off by default: the reactive signals alone
    assert POLICY.decide(RAMP, p.PolicyState(), spec(**PREDICT_SPEC)).replicas == 4


def test_a_forecast_waits_with_the_rate_while_the_fallback_absorbs() -> None:
    fields = {**PREDICT_SPEC, "max_fallback_share": 0.05, "predictive": True}
    absorbed = dataclasses.replace(RAMP, fallback_share=0.01)  # growth the fallback takes
    decision = POLICY.decide(absorbed, p.PolicyState(), spec(**fields))
    assert (decision.replicas, decision.reason) == (4, p.FALLBACK_ABSORBING), decision.message
    sustained = dataclasses.replace(RAMP, fallback_share=0.2)  # the overflow is the replicas'
    decision = POLICY.decide(sustained, p.PolicyState(), spec(**fields))
    assert (decision.replicas, decision.reason) == (5, p.FORECAST), decision.message


def test_a_forecast_never_lowers_an_ask_and_its_ask_is_held_for_the_window() -> None:
    # falling load: the history reads a trend down, which is no forecast
    falling = tuple((t, 40.0 * (t - NOW + 300) - c) for t, c in _ramp_history(NOW, 0.0, 0.05))
    down = dataclasses.replace(
        RAMP, admitted_history=falling, request_rate=30.0, recent_request_rate=30.0
    )
    decision = POLICY.decide(down, p.PolicyState(), spec(**PREDICT_SPEC, predictive=True))
    assert decision.replicas == 6 and "rate trend" not in decision.message
    # the forecast's scale-up is remembered: the flat load after it waits the whole window
    up = POLICY.decide(RAMP, p.PolicyState(), spec(**PREDICT_SPEC, predictive=True))
    state, replicas = up.state, []
    for k in range(1, 62):
        flat = dataclasses.replace(
            obs(5, *[rep(0, 16, 0.4)] * 5, now=NOW + 5.0 * k, rate=18.5), admitted_history=()
        )
        d = POLICY.decide(flat, state, spec(**PREDICT_SPEC, predictive=True))
        state = d.state
        replicas.append(d.replicas)
    assert replicas[:59] == [5] * 59 and replicas[-1] == 4  # one change, after the window


def test_before_a_rate_is_learned_the_fleet_is_not_scaled_below_what_carries_the_load() -> None:
    """Issue 38: five replicas carry 30 requests/s below saturation (KV 0.46, no queue),
    nothing learned yet, a fallback. KV alone asks for 3, and after the scale-down window the
    fleet went to 4 and the fallback overflowed. The most one replica has answered (6/s) is
    a lower bound of its capacity: the rate at 0.8 of it asks for 5, so the fleet holds."""
    carrying = dataclasses.replace(
        obs(5, *[rep(0, 10, 0.46)] * 5, rate=30), replica_answer_rate=30.0, fallback_share=0.0
    )
    fields = {"max_replicas": 10, "max_fallback_share": 0.05, **DOWN_NOW}
    first = POLICY.decide(carrying, p.PolicyState(), spec(**fields))
    assert first.replicas == 5, first.message
    assert first.state.peak_rate == pytest.approx(6.0) and first.state.learned_rate is None
    # the peak persists in the status; a lighter period keeps it, and the rate still rules
    status = first.state.to_status()
    assert status["peakRequestsPerReplica"] == 6.0
    state = p.PolicyState.from_status(status)
    lighter = dataclasses.replace(carrying, now=NOW + 5, request_rate=18.0, recent_request_rate=18.0,
                                  replica_answer_rate=18.0)  # fmt: skip
    after = POLICY.decide(lighter, state, spec(**fields))
    assert after.state.peak_rate == pytest.approx(6.0)
    assert after.replicas == 4  # 18 / (0.8 x 6) asks 4
    # the peak asks for no growth: a rate above what the fleet carried waits for the queue
    heavier = dataclasses.replace(
        carrying, now=NOW + 5, request_rate=60.0, recent_request_rate=60.0
    )
    assert POLICY.decide(heavier, state, spec(**fields)).replicas == 5
    for odd in ("x", -1, 0, float("inf"), None):
        assert p.PolicyState.from_status({"peakRequestsPerReplica": odd}).peak_rate is None
