"""The fleet's status rows: quantiles from histograms, shares, and the runtime's views."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kubellm import manifests, metrics
from kubellm.fleet import status
from kubellm.fleet.processes import Supervisor, restart_delay
from kubellm.fleet.runtime import LocalBackend, LocalRuntime, secret_env_var


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
