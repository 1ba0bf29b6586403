"""The fleet's status rows: quantiles from histograms, shares, and the runtime's views."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubellm.operator.rollout import Counters
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kubellm import manifests, metrics
from kubellm.contracts import revision
from kubellm.fleet import status
from kubellm.fleet.processes import Replica, Supervisor, restart_delay
from kubellm.fleet.runtime import LocalBackend, LocalRuntime, secret_env_var
from tests.fixtures.canary import c


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.1, 10.0), (0.2, 30.0), (0.4, 40.0), (float("inf"), 40.0)]
    assert metrics.histogram_quantile(0.5, buckets) == pytest.approx(0.15)
    assert metrics.histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert metrics.histogram_quantile(0.875, buckets) == pytest.approx(0.3)
    assert metrics.histogram_quantile(0.5, []) is None
    assert metrics.histogram_quantile(0.99, [(1.0, 0.0), (float("inf"), 5.0)]) == 1.0


def _gateway_text() -> str:
    registry = CollectorRegistry()
    labels = ["model", "deployment", "namespace"]
    requests = Counter(metrics.GATEWAY_REQUESTS, "", [*labels, "target", "code"], registry=registry)
    ttft = Histogram(metrics.GATEWAY_TTFT, "", labels, buckets=(0.1, 0.5, 1.0), registry=registry)
    for _ in range(3):
        requests.labels("m", "d", "ns", "replica", "200").inc()
        ttft.labels("m", "d", "ns").observe(0.05)
    requests.labels("m", "d", "ns", "fallback", "200").inc()
    requests.labels("other", "o", "ns", "replica", "200").inc(10)
    return generate_latest(registry).decode()


def _engine_text(waiting: float, usage: float) -> str:
    registry = CollectorRegistry()
    Gauge(metrics.NUM_REQUESTS_WAITING, "", registry=registry).set(waiting)
    Gauge(metrics.KV_CACHE_USAGE, "", registry=registry).set(usage)
    return generate_latest(registry).decode()


def test_model_row_from_gateway_and_engine_metrics() -> None:
    row = status.model_row(
        "m", _gateway_text(), [_engine_text(3, 0.2), _engine_text(1, 0.6)], ready=2, desired=3
    )
    assert row.requests == 4
    assert row.fallback_share == pytest.approx(0.25)
    assert row.queue == 4
    assert row.kv_cache_usage == pytest.approx(0.4)
    assert row.ttft_p50 == pytest.approx(0.05)
    table = status.format_table([row])
    assert "2/3" in table and "25%" in table and table.splitlines()[0].startswith("MODEL")


def test_the_adapters_table_shows_loaded_and_active_of_ready_replicas() -> None:
    plain = status.ModelRow("plain")
    assert status.format_adapters([plain]) == ""  # no adapters: no table
    lora = status.ModelRow("base", adapters=[
        {"name": "sql", "loadedReplicas": 2, "activeReplicas": 1, "replicas": 2},
        {"name": "legal", "loadedReplicas": 0, "activeReplicas": 0, "replicas": 2},
    ])  # fmt: skip
    lines = status.format_adapters([plain, lora]).splitlines()
    assert lines[0].split() == ["MODEL", "ADAPTER", "LOADED", "ACTIVE"]
    assert lines[1].split() == ["base", "sql", "2/2", "1/2"]
    assert lines[2].split() == ["base", "legal", "0/2", "0/2"]


def test_restart_backoff_doubles_and_caps() -> None:
    assert [restart_delay(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert restart_delay(20) == 60.0


def test_secret_env_var_name() -> None:
    from kubellm.api import SecretKeyRef

    assert (
        secret_env_var(SecretKeyRef(name="fallback-api", key="api-key")) == "FALLBACK_API_API_KEY"
    )


def _llmd(name: str, **spec) -> object:
    return manifests.parse(
        {
            "apiVersion": "kubellm.io/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": name},
            "spec": {"model": {"source": "file:///m"}, **spec},
        }
    )


async def test_runtime_apply_is_like_kubectl_apply(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path / "logs")
    runtime = LocalRuntime(supervisor, tmp_path, engine="sim")
    assert runtime.apply([_llmd("a"), _llmd("b", replicas=2)]) == [
        "a created with 1 replica(s)",
        "b created with 2 replica(s)",
    ]
    assert supervisor.desired == {"a": 1, "b": 2}
    assert runtime.apply([_llmd("a", replicas=3)]) == ["b removed", "a scaled to 3"]
    assert supervisor.desired == {"a": 3, "b": 0}
    changes = runtime.apply([_llmd("a", replicas=3, engine={"maxModelLen": 512})])
    assert changes == ["a engine spec changed: replacing replicas"]
    assert runtime.apply([_llmd("a", replicas=3, engine={"maxModelLen": 512})]) == []


async def test_local_backend_lists_only_autoscaled_deployments(tmp_path: Path) -> None:
    runtime = LocalRuntime(Supervisor(tmp_path / "logs"), tmp_path, engine="sim")
    runtime.apply([_llmd("fixed"), _llmd("scaled", autoscaling={"maxReplicas": 3})])
    backend = LocalBackend(runtime)
    (target,) = await backend.targets()
    assert target.name == "scaled" and target.replicas == 1
    await backend.write_replicas(target, 3)
    assert runtime.desired_replicas("scaled") == 3
    await backend.write_status(target, {"desiredReplicas": 3, "reason": "QueueDepth"})
    await backend.write_status(target, {"reason": None})
    assert runtime.deployments["scaled"].autoscaler_status == {"desiredReplicas": 3}


def test_events_keep_printing_past_the_kept_window(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    for i in range(150):
        supervisor.event(f"e{i}")
    assert len(supervisor.events) == 100
    assert supervisor.events_since(149) == ["e149"]
    supervisor.event("e150")
    assert supervisor.events_since(150) == ["e150"]
    assert supervisor.events_since(151) == []
    assert supervisor.events_since(0)[0] == "e51"  # older ones were dropped, not replayed


def _canary_llmd(source: str, **meta: Any) -> object:
    return manifests.parse(
        {
            "apiVersion": "kubellm.io/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": "m", **meta},
            "spec": {
                "model": {"source": source},
                "replicas": 4,
                "rollout": {
                    "strategy": "Canary",
                    "steps": [{"weight": 25, "pauseSeconds": 0}],
                    "analysis": {"minRequests": 10},
                },
            },
        }
    )


def _mark_ready(supervisor: Supervisor, key: str, tmp_path: Path) -> None:
    """Play the supervisor: the wanted replicas of `key` run and pass /health."""
    replicas = supervisor.replicas.setdefault(key, [])
    replicas[:] = [r for r in replicas if r.state == "ready"][: supervisor.desired.get(key, 0)]
    while len(replicas) < supervisor.desired.get(key, 0):
        index = len(replicas)
        replicas.append(Replica(key, index, 40000 + index + (100 if "canary" in key else 0),
                                [], tmp_path / "x.log", state="ready"))  # fmt: skip


def _served(requests: int, ttft: float) -> Counters:
    return c(requests=requests, ttft=ttft)


async def test_the_local_fleet_runs_a_canary_beside_the_stable_replicas(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path / "logs")
    runtime = LocalRuntime(supervisor, tmp_path, engine="sim")
    runtime.apply([_canary_llmd("file:///v1")])
    _mark_ready(supervisor, "m", tmp_path)
    assert runtime.tend_rollout({}, 100.0) == []  # nothing to roll out
    stable_spec = (tmp_path / "m.json").read_text()
    bad = _canary_llmd("file:///v2", annotations={"kubellm.io/sim-slow-steps": "3"})
    (change,) = runtime.apply([bad])
    assert "starts as a canary" in change
    assert (tmp_path / "m.json").read_text() == stable_spec  # stable replicas keep their spec
    assert "file:///v2" in (tmp_path / "m--canary.json").read_text()
    assert "--slow-steps" in supervisor.commands["m--canary"]("m--canary", 1)
    lines = runtime.tend_rollout({}, 101.0)
    assert any("CanaryStarted" in line for line in lines)
    assert (supervisor.desired["m"], supervisor.desired["m--canary"]) == (3, 1)
    _mark_ready(supervisor, "m", tmp_path)
    _mark_ready(supervisor, "m--canary", tmp_path)
    old = revision(runtime.deployments["m"].stable)
    new = revision(bad)
    runtime.tend_rollout({"m": {old: _served(100, 0.2)}}, 102.0)  # the window opens
    target = runtime.gateway_targets()["m"]
    assert target.canary is not None and target.canary.weight == 25
    assert sorted(e.revision or "" for e in target.endpoints) == ["", "", "", new]
    slow = {"m": {old: _served(130, 0.2), new: _served(10, 0.6)}}
    lines = runtime.tend_rollout(slow, 103.0)
    assert any("RolledBack" in line for line in lines)
    assert (supervisor.desired["m"], supervisor.desired["m--canary"]) == (4, 0)
    assert runtime.gateway_targets()["m"].canary.weight == 0
    # a person promotes it anyway (the manifest's annotation, as kubectl annotate would)
    promoted = _canary_llmd("file:///v2", annotations={"kubellm.io/rollout-action": "promote"})
    runtime.apply([promoted])
    runtime.tend_rollout(slow, 104.0)
    assert runtime.deployments["m"].rollout_status["phase"] == "Promoting"
    assert "file:///v2" in (tmp_path / "m.json").read_text()  # the stable ones take it
    _mark_ready(supervisor, "m", tmp_path)
    lines = runtime.tend_rollout(slow, 105.0)
    assert any("Promoted" in line for line in lines)
    assert "m--canary" not in supervisor.commands and supervisor.desired["m"] == 4
    assert runtime.deployments["m"].rollout_status["phase"] == "Stable"
    assert runtime.gateway_targets()["m"].canary is None


@pytest.mark.parametrize("renamed", [False, True])
async def test_a_deployment_removed_or_renamed_mid_rollout_takes_its_canary_with_it(
    tmp_path: Path, renamed: bool
) -> None:
    supervisor = Supervisor(tmp_path / "logs")
    runtime = LocalRuntime(supervisor, tmp_path, engine="sim")
    runtime.apply([_canary_llmd("file:///v1")])
    _mark_ready(supervisor, "m", tmp_path)
    runtime.apply([_canary_llmd("file:///v2")])
    runtime.tend_rollout({}, 101.0)
    assert supervisor.desired["m--canary"] == 1 and "m--canary" in supervisor.commands
    other = _canary_llmd("file:///v2").model_copy(deep=True)
    other.metadata.name = "n"
    changes = runtime.apply([other] if renamed else [])
    assert "m removed" in changes
    runtime.tend_rollout({}, 102.0)
    assert supervisor.desired["m--canary"] == 0 and "m--canary" not in supervisor.commands
    assert supervisor.desired["m"] == 0
