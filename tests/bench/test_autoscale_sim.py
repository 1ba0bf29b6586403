"""The fleet simulation behind bench/autoscale_sim.py, on tiny traces (seconds of CPU).

It asserts behaviour, not figures: a queue past its target gets a scale-up
decision within one control period, new replicas start before they serve, a
fixed fleet never changes, a scale-down drains before it removes, runs are
deterministic, and the summary JSON and the plot are written.
"""

from __future__ import annotations

import json

import pytest
from kubellm.autoscaler import policy as policies

from bench import autoscale_sim
from bench._autoscale import experiment, traces
from bench._autoscale.fleet import Fleet, FleetConfig, Result
from kubellm import api

CAPACITY = experiment.CAPACITY_RPS["long"]
MIX = traces.MIXES["long"]


def step_trace(before: float = 30.0, duration: float = 90.0, high: float = 3.0) -> traces.Trace:
    low, high = 0.5 * CAPACITY, high * CAPACITY
    return traces.Trace("tiny-step", duration, lambda t: low if t < before else high, high, "")


def fleet_config(initial: int = 1, load: float = 20.0, **autoscaling: object) -> FleetConfig:
    spec = experiment.autoscaling().model_copy(update=autoscaling)
    return FleetConfig(
        experiment.profile(), spec, api.SLO(), initial_replicas=initial, load_seconds=load
    )


def run(trace: traces.Trace, config: FleetConfig, policy: policies.Policy | None) -> Result:
    return Fleet(config, policy, trace.arrivals(0, MIX), trace.duration, trace.name).run()


@pytest.fixture(scope="module")
def stepped() -> Result:
    """The kv-queue policy on a tiny step (shared: the simulation is deterministic).

    The rate signal is off here, so the scale-up is the queue's reflex alone
    (with it on, a noisy period before the step may add a replica first).
    """
    config = fleet_config(target_requests_per_replica=None)
    return run(step_trace(), config, policies.get("kv-queue"))


def test_step_scales_up_within_one_period_of_the_queue_passing_its_target(stepped: Result) -> None:
    result, config = stepped, fleet_config()

    assert result.queue_episodes, "the step must push the queue past its target"
    ups = [d for d in result.decisions if d[2] > d[1]]
    assert ups, "the policy never scaled up"
    first_up = ups[0][0]
    started = [start for start, decided in result.queue_episodes if decided == first_up]
    assert started, f"the first scale-up at {first_up} s resolved no queue episode"
    assert 0 <= first_up - started[0] <= config.period
    assert first_up >= 30.0  # not before the step


def test_new_replicas_are_starting_for_the_load_delay_then_ready(stepped: Result) -> None:
    result, config = stepped, fleet_config()
    first_up, before, after = next((t, a, b) for t, a, b, _ in result.decisions if b > a)

    loading = [s for s in result.samples if first_up <= s.time < first_up + config.load_seconds]
    assert loading and all(s.ready == before for s in loading)
    assert all(s.starting >= after - before for s in loading[:1])
    later = [s for s in result.samples if s.time >= first_up + config.load_seconds]
    assert later and later[0].ready >= after


def test_fixed_fleet_never_changes_replicas() -> None:
    result = run(step_trace(), fleet_config(initial=2), None)

    assert result.decisions == []
    assert {(s.ready, s.starting, s.draining, s.desired) for s in result.samples} == {(2, 0, 0, 2)}
    assert result.replica_seconds == pytest.approx(2 * result.duration)


def test_scale_down_drains_in_flight_requests_before_removing_a_replica() -> None:
    # High, then almost nothing; no scale-down window, so the fleet shrinks inside the trace.
    high, duration = 2.5 * CAPACITY, 150.0
    trace = traces.Trace("drop", duration, lambda t: high if t < 60 else 0.2, high, "")
    config = fleet_config(initial=3, scale_down_stabilization_seconds=0)
    result = run(trace, config, policies.get("kv-queue"))

    downs = [d for d in result.decisions if d[2] < d[1]]
    assert downs, "the load drop never scaled the fleet down"
    assert any(s.draining for s in result.samples), "no busy replica was drained"
    assert result.finished == result.requests  # nobody's request was dropped by a scale-down
    assert result.replica_seconds < 3 * duration


def test_runs_are_deterministic_for_a_seed(stepped: Result) -> None:
    trace = step_trace()
    assert trace.arrivals(3, MIX) == trace.arrivals(3, MIX)
    assert trace.arrivals(3, MIX) != trace.arrivals(4, MIX)
    again = run(trace, fleet_config(target_requests_per_replica=None), policies.get("kv-queue"))
    assert (again.met, again.decisions, again.replica_seconds) == (
        stepped.met,
        stepped.decisions,
        stepped.replica_seconds,
    )


def test_the_gateway_counters_reach_the_policy_as_a_request_rate() -> None:
    rate = 1.2 * CAPACITY  # one replica copes for a while: no queue yet, but the rate asks 2
    trace = traces.Trace("flat", 30.0, lambda t: rate, rate, "")
    result = run(trace, fleet_config(), policies.get("kv-queue"))

    assert result.decisions, "the request rate never asked for a second replica"
    _, before, after, message = result.decisions[0]
    assert (before, after) == (1, 2) and message.startswith(policies.REQUEST_RATE)


def test_without_a_rate_target_the_fleet_has_no_rate_signal() -> None:
    rate = 1.2 * CAPACITY
    trace = traces.Trace("flat", 30.0, lambda t: rate, rate, "")
    config = fleet_config(target_requests_per_replica=None)
    result = run(trace, config, policies.get("kv-queue"))
    assert all("req/s" not in message for *_, message in result.decisions)


@pytest.mark.parametrize(
    ("steps", "changes"),
    [
        ([(0, 1, 2), (5, 2, 3)], []),  # up, up
        ([(0, 1, 2), (5, 2, 1)], [5]),  # up, down
        ([(0, 3, 2), (5, 2, 3), (9, 3, 1), (20, 1, 1)], [5, 9]),  # a no-op is no direction
        ([], []),
    ],
)
def test_direction_changes(steps: list[tuple[float, int, int]], changes: list[float]) -> None:
    decisions = [(t, a, b, "") for t, a, b in steps if a != b]
    assert experiment.direction_changes(decisions) == changes


def test_most_changes_in_any_window() -> None:
    assert experiment.max_in_window([], 300) == 0
    assert experiment.max_in_window([0, 100, 500], 300) == 2
    assert experiment.max_in_window([0, 400, 450, 700], 300) == 3


def test_bench_writes_the_summary_and_the_plot(tmp_path, capsys) -> None:
    code = autoscale_sim.main(
        ["--traces", "step", "--policies", "kv-queue,fixed", "--scale", "0.2", "--jobs", "1",
         "--load-seconds", "20", "--no-curve", "--out", str(tmp_path)]
    )  # fmt: skip

    assert code == 0
    printed = capsys.readouterr().out
    assert "kv-queue" in printed and "fixed" in printed and "step:" in printed
    document = json.loads((tmp_path / "summary.json").read_text())
    assert {(r["trace"], r["policy"]) for r in document["runs"]} == {
        ("step", "kv-queue"),
        ("step", "fixed"),
    }
    for row in document["runs"]:
        for field in (
            "slo_attainment",
            "goodput_rps",
            "replica_seconds",
            "direction_changes",
            "max_direction_changes_per_scale_down_window",
            "first_queue_to_scale_up_s",
            "ttft_p95_s",
        ):
            assert field in row
        assert 0 <= row["slo_attainment"] <= 1
    fixed = next(r for r in document["runs"] if r["policy"] == "fixed")
    assert fixed["direction_changes"] == 0 and fixed["decisions"] == []
    assert any("step" in c["target"] for c in document["targets"])
    assert (tmp_path / "autoscale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--traces", "sawtooth"], "--traces"),
        (["--policies", "hpa"], "--policies"),
        (["--scale", "0"], "--scale"),
        (["--set", "minReplica=2"], "minReplica"),
        (["--set", "targetQueueDepth=-1"], "targetQueueDepth"),
        (["--set", "targetRequestsPerReplica=0"], "targetRequestsPerReplica"),
    ],
)
def test_bad_arguments_name_the_option(argv: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit):
        autoscale_sim.parse_args(argv)
    assert named in capsys.readouterr().err


def test_what_if_overrides_reach_the_spec() -> None:
    args = autoscale_sim.parse_args(["--set", "minReplicas=2", "--set", "targetKVCacheUsage=0.4"])
    assert dict(args.spec) == {"min_replicas": 2, "target_kv_cache_usage": 0.4}
    off = autoscale_sim.parse_args(["--set", "targetRequestsPerReplica=none"])
    assert dict(off.spec) == {"target_requests_per_replica": None}
