"""The fleet simulation behind bench/autoscaler/autoscale_sim.py, on tiny traces (seconds of CPU).

It asserts behaviour, not figures: a queue past its target gets a scale-up
decision within one control period, new replicas start before they serve, a
fixed fleet never changes, a scale-down drains before it removes, runs are
deterministic, and the summary JSON and the plot are written.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from kubellm.autoscaler import policy as policies

from bench.autoscaler import autoscale_sim
from kubellm import api
from kubellm.simulation import experiment, traces
from kubellm.simulation.fleet import Fleet, FleetConfig, Result

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
    # High, then low (0.3 x a replica's capacity: the gateway's least-load keeps every
    # replica busy, so the one removed has requests in flight); no scale-down window, so the
    # fleet shrinks inside the trace.
    high, low, duration = 2.5 * CAPACITY, 0.3 * CAPACITY, 150.0
    trace = traces.Trace("drop", duration, lambda t: high if t < 60 else low, high, "")
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


def test_the_default_spec_does_not_flap_under_steady_load() -> None:
    """Issue #17: a new user's spec (no targetRequestsPerReplica) under a steady load.

    Before, KV usage and queue read near zero until saturation, so the fleet went up on
    the queue, down once they read low, and up again (1 -> 4 -> 2 -> 1 -> 4). Now the
    policy learns what a replica serves while saturated and holds the fleet there.
    """
    rate = 1.6 * CAPACITY
    trace = traces.Trace("steady", 700.0, lambda t: rate, rate, "")
    config = FleetConfig(
        experiment.profile(), api.Autoscaling(max_replicas=8), api.SLO(), load_seconds=60.0
    )
    result = run(trace, config, policies.get("kv-queue"))

    assert result.decisions, "a steady 1.6 replicas' worth never scaled one replica up"
    assert experiment.direction_changes(result.decisions) == [], result.decisions
    assert any("target derived" in message for *_, message in result.decisions)
    assert result.samples[-1].ready >= 2  # it serves the load


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


def test_the_first_row_is_the_shipped_defaults() -> None:
    assert experiment.POLICIES[0] == experiment.DEFAULTS
    job = experiment.Job("step", experiment.DEFAULTS, scale=0.2)
    summary, result = experiment.run(job)
    shipped = api.Autoscaling()
    # what the spec leaves unset stays unset (derived), the fallback's share is the spec's own
    assert summary["target_requests_per_replica"] is None
    assert summary["max_fallback_share"] == shipped.max_fallback_share
    assert summary["fallback_cost_ratio"] is None
    assert result.requests > 0


# ---------------------------------------------------------------- the fallback and the cost


def test_overflow_goes_to_the_fallback_through_the_production_admission() -> None:
    from kubellm.simulation import gateway

    high = 2.5 * CAPACITY  # one replica, no scaling: the overflow has to go somewhere
    trace = traces.Trace("flat", 40.0, lambda t: high, high, "")
    config = dataclasses.replace(fleet_config(initial=1), fallback=gateway.ApiModel())
    result = run(trace, config, None)

    assert result.fallback_requests > 0 and result.replica_answers > 0
    assert result.fallback_requests + result.replica_answers + result.rejected >= result.finished
    assert result.fallback_prompt_tokens > result.fallback_requests  # tokens, not requests
    assert sum(s.fallback for s in result.samples) <= result.fallback_requests
    # the same fleet without the fallback misses the SLO for what the fallback served in time
    alone = run(trace, fleet_config(initial=1), None)
    assert result.met > alone.met


def test_the_admission_is_the_gateways_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decision of the simulated gateway is production's pass (`admit_once`)."""
    from kubellm.gateway.routing import dispatch

    from kubellm.simulation import gateway

    calls = []

    def counted(*args: object) -> object:
        calls.append(args)
        return dispatch.admit_once(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gateway, "admit_once", counted)
    trace = traces.Trace("flat", 10.0, lambda t: 2.0, 2.0, "")
    result = run(trace, fleet_config(), policies.get("kv-queue"))
    assert result.requests and len(calls) >= result.requests


def test_cost_is_gpu_hours_plus_the_tokens_the_api_served() -> None:
    from kubellm.simulation import gateway

    model = gateway.ApiModel(input_price_per_million=1.0, output_price_per_million=4.0)
    result = Result("t", "p", 3600.0, requests=10)
    result.replica_seconds = 7200.0
    result.fallback_requests, result.fallback_prompt_tokens = 10, 2_000_000
    result.fallback_output_tokens = 500_000
    figures = experiment.costs(result, model, gpu_hour_price=3.0)
    assert figures["gpu_cost"] == pytest.approx(6.0)  # 2 GPU-hours at $3
    assert figures["api_cost"] == pytest.approx(2.0 + 2.0)
    assert figures["cost"] == pytest.approx(10.0) and figures["fallback_share"] == 1.0


def test_the_breakdown_splits_replica_seconds_by_what_the_load_needed(stepped: Result) -> None:
    trace = step_trace()
    parts = experiment.breakdown(stepped, trace, "long", min_replicas=1)
    # the step asks for ceil(3 x capacity / capacity) = 3 replicas from t=30; the fleet starts
    # at 1: it falls short while new replicas load, and those load for the 20 s given
    assert parts["short"] > 0 and parts["loading"] > 0
    sampled = sum(parts[k] for k in ("loading", "draining", "needed", "headroom"))
    assert sampled == pytest.approx(stepped.replica_seconds, rel=0.1)
    assert sum(h["needed"] for h in parts["per_hour"]) == parts["needed"]
    # a fixed fleet of 4 on the same trace: no loading, spare replicas as headroom
    fixed = run(trace, fleet_config(initial=4), None)
    fixed_parts = experiment.breakdown(fixed, trace, "long", min_replicas=1)
    assert fixed_parts["loading"] == fixed_parts["short"] == 0
    # sampled from t=5: 5 periods needing 1 (3 spare), then 12 needing 3 (1 spare)
    assert fixed_parts["headroom"] == pytest.approx(5.0 * (5 * 3 + 12 * 1))


def test_all_api_meets_the_slo_only_when_the_apis_latency_does() -> None:
    from kubellm.simulation import gateway

    arrivals = step_trace().arrivals(0, MIX)
    fast = experiment.all_api(arrivals, 90.0, gateway.ApiModel(), api.SLO(), "t")
    slow = experiment.all_api(arrivals, 90.0, gateway.ApiModel(ttft_seconds=3.0), api.SLO(), "t")
    assert fast.met == len(arrivals) and slow.met == 0
    assert fast.replica_seconds == 0 and fast.fallback_requests == len(arrivals)


# ---------------------------------------------------------------- recorded traces


def write_csv(path, header: str, rows: list[str]) -> None:
    path.write_text(header + "\n" + "\n".join(rows) + "\n")


def test_a_csv_trace_with_azure_style_columns_and_iso_times(tmp_path) -> None:
    path = tmp_path / "azure.csv"
    write_csv(
        path,
        "TIMESTAMP,ContextTokens,GeneratedTokens",
        ["2023-11-16 18:15:46.6805900,374,44", "2023-11-16 18:15:50.9951690,396,109",
         "2023-11-16 18:15:47.0,99999,0"],
    )  # fmt: skip
    trace = traces.read_csv(path)
    arrivals = trace.arrivals(0)
    assert [round(a.time, 3) for a in arrivals] == [0.0, 0.319, 4.315]
    assert arrivals[1].prompt_tokens == traces.MAX_PROMPT_TOKENS and arrivals[1].output_tokens == 1
    assert trace.clipped == 1 and trace.duration == pytest.approx(5.315, abs=1e-3)


def test_rate_scale_superposes_shifted_copies(tmp_path) -> None:
    path = tmp_path / "t.csv"
    write_csv(path, "timestamp,input_tokens,output_tokens", [f"{t},100,10" for t in range(100)])
    one = traces.read_csv(path)
    three = traces.read_csv(path, rate_scale=3, seed=1)
    half = traces.read_csv(path, rate_scale=2.5, seed=1)
    assert len(three.arrivals(0)) == 300 and three.duration == one.duration
    assert 225 <= len(half.arrivals(0)) <= 275
    assert all(0 <= a.time < one.duration for a in three.arrivals(0))
    assert three.arrivals(0) == traces.read_csv(path, rate_scale=3, seed=1).arrivals(0)


@pytest.mark.parametrize(
    ("header", "rows", "named"),
    [
        ("when,prompt_tokens,output_tokens", ["0,1,1", "1,1,1"], "timestamp"),
        ("timestamp,prompt,output_tokens", ["0,1,1", "1,1,1"], "prompt-token"),
        ("timestamp,prompt_tokens,output_tokens", ["0,1,1", "soon,1,1"], ":3: timestamp"),
        ("timestamp,prompt_tokens,output_tokens", ["0,1,1", "1,many,1"], ":3: prompt_tokens"),
        ("timestamp,prompt_tokens,output_tokens", ["0,1,1"], "at least two"),
    ],
)
def test_a_bad_trace_is_refused_naming_the_column_and_line(
    tmp_path, header: str, rows: list[str], named: str
) -> None:
    path = tmp_path / "bad.csv"
    write_csv(path, header, rows)
    with pytest.raises(traces.TraceError, match=named):
        traces.read_csv(path)


def test_bench_runs_a_csv_trace_and_writes_the_json(tmp_path, capsys) -> None:
    path = tmp_path / "burst.csv"
    rows = [f"{i / 6:.3f},2400,150" for i in range(6 * 40)]  # 6/s for 40 s
    write_csv(path, "timestamp,prompt_tokens,output_tokens", rows)
    code = autoscale_sim.main(
        ["--trace", str(path), "--rate-scale", "2", "--policies", "fixed,kv-queue+fallback,all-api",
         "--fallback-shares", "", "--jobs", "1", "--load-seconds", "20", "--no-curve",
         "--no-plot", "--out", str(tmp_path), "--json", str(tmp_path / "figures.json"),
         "--gpu-hour-price", "4", "--api-input-price-per-million", "1"]
    )  # fmt: skip

    assert code == 0
    printed = capsys.readouterr().out
    assert "burst" in printed and "cost $" in printed and "$4 per GPU-hour" in printed
    figures = json.loads((tmp_path / "figures.json").read_text())["burst"]
    assert set(figures) == {"fixed", "kv-queue+fallback", "all-api"}
    for row in figures.values():
        assert set(row) == {
            "attainment", "goodput", "replica_seconds", "fallback_requests", "fallback_tokens",
            "cost", "direction_changes", "max_changes_per_window",
        }  # fmt: skip
    api_only = figures["all-api"]
    assert api_only["replica_seconds"] == 0 and api_only["fallback_requests"] == 480
    assert api_only["cost"] == pytest.approx(480 * (2400 * 1.0 + 150 * 0.2) / 1e6, abs=1e-4)
    fixed = figures["fixed"]
    assert fixed["cost"] == pytest.approx(fixed["replica_seconds"] / 900, abs=1e-4)


def test_a_bad_trace_flag_names_the_flag(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        autoscale_sim.parse_args(["--trace", str(tmp_path / "missing.csv")])
    assert "--trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        autoscale_sim.parse_args(["--gpu-hour-price", "-1"])
    assert "--gpu-hour-price" in capsys.readouterr().err


# ---------------------------------------------------------------- the cost rule keeps the SLO


@pytest.fixture(scope="module")
def cost_rule_runs() -> dict[tuple[str, str], tuple[dict, Result, list[traces.Arrival]]]:
    """The cost rule and the share rule on the step and the ramp (full length) and the
    bursty day at a quarter of its length (90 minutes, spikes of 7-37 s): (summary, result,
    arrivals) per run."""
    runs = {}
    for trace, scale in (("step", 1.0), ("ramp", 1.0), ("bursty-day", 0.25)):
        for policy in (experiment.FALLBACK, experiment.COST):
            job = experiment.Job(trace, policy, scale=scale)
            summary, result = experiment.run(job)
            arrivals = experiment.load_trace(job).arrivals(job.seed, MIX)
            runs[(trace, policy)] = (summary, result, arrivals)
    return runs


@pytest.mark.parametrize("trace", ["ramp", "bursty-day"])
def test_the_cost_rule_keeps_attainment_at_99_percent(cost_rule_runs, trace: str) -> None:
    summary = cost_rule_runs[(trace, experiment.COST)][0]
    assert summary["fallback_cost_ratio"] > 1  # the rule was on: the API dearer than a replica
    assert summary["slo_attainment"] >= 0.99, summary["slo_attainment"]


def after_scale_downs(result: Result, arrivals: list[traces.Arrival], window: float) -> tuple:
    """(requests, met) among those arriving within `window` after any scale-down decision:
    the requests a scale-down could have cost their SLO."""
    downs = [t for t, before, after, _ in result.decisions if after < before]
    exposed = [a.time for a in arrivals if any(t <= a.time < t + window for t in downs)]
    missed = sum(1 for t in result.missed if any(d <= t < d + window for d in downs))
    return len(exposed), len(exposed) - missed


@pytest.mark.parametrize("policy", [experiment.FALLBACK, experiment.COST])
@pytest.mark.parametrize("trace", ["step", "ramp", "bursty-day"])
def test_the_scale_down_rule_never_lets_attainment_fall_under_99_percent(
    cost_rule_runs, trace: str, policy: str
) -> None:
    """Issue #31's acceptance: of the requests arriving in the scale-down window after any
    scale-down (its hold, then a model load's time to undo it), 99% meet the SLO, under the
    share rule and the cost rule. On the step and the ramp no scale-down may come at all: the
    step's load only rises, and the ramp's descent (144 s) is shorter than the 300 s hold.
    (The step's misses come before: a 3.5x step overflows the fallback while replicas load;
    that is the scale-up's reflex, not the scale-down rule.)"""
    summary, result, arrivals = cost_rule_runs[(trace, policy)]
    window = summary["scale_down_stabilization_seconds"] + experiment.LOAD_SECONDS
    downs = [d for d in result.decisions if d[2] < d[1]]
    exposed, met = after_scale_downs(result, arrivals, window)
    if trace in ("step", "ramp"):
        assert downs == [] and exposed == 0
        return
    assert downs and exposed > 1000, "the bursty day must exercise the rule"
    assert met >= 0.99 * exposed, f"{met}/{exposed} after {len(downs)} scale-downs"


def test_on_the_step_the_cost_rule_loses_nothing_to_the_share_rule(cost_rule_runs) -> None:
    # a step to 3.5 replicas' worth overflows the fallback (64 at once) while replicas load
    # for 60 s: no rule reaches 99% there; the cost rule must not wait any longer than the
    # share rule (the fallback fills at once, and a full fallback ends the wait)
    cost, share = (cost_rule_runs[("step", p)][0] for p in (experiment.COST, experiment.FALLBACK))
    assert cost["slo_attainment"] >= share["slo_attainment"]
    assert cost["step_to_scale_up_s"] <= share["step_to_scale_up_s"]


def test_a_run_starts_with_the_fleet_its_first_minute_asks() -> None:
    spec = experiment.autoscaling(target_requests_per_replica=7.0)
    flat = traces.Trace("flat", 120.0, lambda t: 35.0, 35.0, "").arrivals(0, MIX)
    assert experiment.warm_start(flat, spec, 7.0) in (5, 6)  # 35 req/s, Poisson
    assert experiment.warm_start(flat, spec.model_copy(update={"max_replicas": 3}), 7.0) == 3
    # the step, the ramp and the bursty day start under one replica's worth: one, as before
    for name in experiment.TRACES:
        arrivals = experiment.make_trace(name).arrivals(0, MIX)
        assert experiment.warm_start(arrivals, spec, 7.0) == 1
    # the generated smooth hour starts at five replicas' worth: a fleet of one was a cold start
    smooth = experiment.make_trace("smooth-hour").arrivals(0, MIX)
    assert experiment.warm_start(smooth, spec, 7.0) >= 4


def test_issue_31s_targets_bound_replica_seconds_by_the_oracles_per_kind_of_trace() -> None:
    from kubellm.simulation import report

    def run(trace: str, policy: str, replica_s: float, attainment: float = 0.995) -> dict:
        return {"trace": trace, "policy": policy, "replica_seconds": replica_s,
                "oracle_replica_seconds": 1000.0, "slo_attainment": attainment,
                "max_direction_changes_per_scale_down_window": 1}  # fmt: skip

    checks = report.oracle_targets(
        [run("bursty-hour", experiment.COST, 1140), run("smooth-hour", experiment.COST, 1060),
         run("bursty-hour", experiment.FALLBACK, 1200, 0.98), run("bursty-hour", "fixed", 9e9)]
    )  # fmt: skip
    met = {(c["policy"], c["target"]): c["met"] for c in checks}
    assert met[(experiment.COST, "bursty-hour: replica-s <= 1.15 x the oracle's")] is True
    assert met[(experiment.COST, "smooth-hour: replica-s <= 1.05 x the oracle's")] is False
    assert met[(experiment.FALLBACK, "bursty-hour: >= 99% of requests meet the SLO")] is False
    assert met[(experiment.FALLBACK, "bursty-hour: replica-s <= 1.15 x the oracle's")] is False
    assert not any(c["policy"] == "fixed" for c in checks)


# ---------------------------------------------------------------- replicas decoding in bulk


@pytest.mark.parametrize("with_fallback", [False, True])
def test_replicas_decoding_in_bulk_give_the_same_run(with_fallback: bool) -> None:
    """`FleetConfig.bulk` (sim_core.BatchEngine, the default) against Engine stepping every
    request: every figure of the run is the same, to the last float."""
    from kubellm.simulation import gateway

    config = fleet_config(load=20.0)
    if with_fallback:
        config = dataclasses.replace(config, fallback=gateway.ApiModel())
    trace = step_trace(duration=75.0, high=3.5)
    bulk = run(trace, config, policies.get("kv-queue"))
    plain = run(trace, dataclasses.replace(config, bulk=False), policies.get("kv-queue"))

    assert bulk.decisions and bulk.finished  # it scaled and served
    assert bulk == plain


def test_the_predictive_twin_scales_ahead_on_the_ramp_and_not_on_the_step() -> None:
    """spec.autoscaling.predictive: on the ramp (growth along a line) it asks for the load one
    model load ahead, without a fallback to wait for; on the step (a surprise, no line) it
    decides exactly as the reactive rule. Both keep at most one direction change a window."""
    runs = {
        (trace, policy): experiment.run(experiment.Job(trace, policy))[0]
        for trace in ("ramp", "step")
        for policy in ("kv-queue", "kv-queue+predict")
    }
    ahead = runs[("ramp", "kv-queue+predict")]
    forecasts = [d for d in ahead["decisions"] if d["message"].startswith("Forecast:")]
    assert forecasts, "the ramp is a trend: some scale-up is the forecast's"
    first_up = lambda s: min(d["time_s"] for d in s["decisions"] if d["to"] > d["from"])  # noqa: E731
    assert first_up(ahead) <= first_up(runs[("ramp", "kv-queue")])
    assert ahead["max_direction_changes_per_scale_down_window"] <= 1
    plain, predicted = runs[("step", "kv-queue")], runs[("step", "kv-queue+predict")]
    assert predicted["decisions"] == plain["decisions"]
    assert predicted["slo_attainment"] == plain["slo_attainment"]
