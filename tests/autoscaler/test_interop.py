"""The HPA and KEDA examples: rendered from the spec, in sync, and valid where a schema exists."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubellm.autoscaler import interop

from kubellm import api, manifests, metrics

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "examples" / "llama-3.1-8b-gpu.yaml"


@pytest.fixture(scope="module")
def deployment() -> api.LLMDeployment:
    [loaded] = manifests.load(SOURCE)
    return loaded


def test_examples_are_in_sync_with_the_renderer(deployment: api.LLMDeployment) -> None:
    assert yaml.safe_load((ROOT / "examples" / "hpa.yaml").read_text()) == interop.hpa(deployment)
    assert yaml.safe_load(
        (ROOT / "examples" / "keda-scaledobject.yaml").read_text()
    ) == interop.keda(deployment, interop.DEFAULT_PROMETHEUS)


def test_hpa_is_valid_and_carries_the_spec(deployment: api.LLMDeployment) -> None:
    hpa = interop.hpa(deployment)
    kubernetes_validate.validate(hpa, "1.31", strict=True)
    spec, autoscaling = hpa["spec"], deployment.spec.autoscaling
    assert spec["scaleTargetRef"] == {
        "apiVersion": "kubellm.io/v1alpha1",
        "kind": "LLMDeployment",
        "name": deployment.metadata.name,
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (
        autoscaling.min_replicas,
        autoscaling.max_replicas,
    )
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in spec["metrics"]}
    assert targets == {
        "vllm_num_requests_waiting": {"type": "AverageValue", "averageValue": "4"},
        "vllm_kv_cache_usage_perc": {"type": "AverageValue", "averageValue": "800m"},
    }
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == (
        autoscaling.scale_down_stabilization_seconds
    )


def test_hpa_never_asks_for_zero(deployment: api.LLMDeployment) -> None:
    zero = deployment.model_copy(deep=True)
    zero.spec.autoscaling.min_replicas = 0
    zero.spec.autoscaling.scale_to_zero = True
    assert interop.hpa(zero)["spec"]["minReplicas"] == 1
    keda = interop.keda(zero)
    assert keda["spec"]["minReplicaCount"] == 0
    assert keda["spec"]["cooldownPeriod"] == zero.spec.autoscaling.idle_seconds_before_zero


def test_keda_triggers_use_the_same_signals(deployment: api.LLMDeployment) -> None:
    keda = interop.keda(deployment, "http://prom:9090")
    triggers = {t["name"]: t for t in keda["spec"]["triggers"]}
    assert set(triggers) == {"queue-depth", "kv-cache-usage", "gateway-pending"}
    assert all(t["type"] == "prometheus" for t in triggers.values())
    assert all(t["metadata"]["serverAddress"] == "http://prom:9090" for t in triggers.values())
    assert metrics.NUM_REQUESTS_WAITING in triggers["queue-depth"]["metadata"]["query"]
    assert triggers["queue-depth"]["metadata"]["threshold"] == "4"
    assert metrics.KV_CACHE_USAGE in triggers["kv-cache-usage"]["metadata"]["query"]
    assert triggers["kv-cache-usage"]["metadata"]["threshold"] == "0.8"
    wake = triggers["gateway-pending"]["metadata"]
    assert f'{metrics.GATEWAY_PENDING}{{model="{deployment.served_name}"}}' in wake["query"]
    assert wake["activationThreshold"] == "0"
    behavior = keda["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior == interop.behavior(deployment.spec.autoscaling)


def test_cli_renders_and_reports_bad_manifests(capsys: pytest.CaptureFixture[str]) -> None:
    assert interop.main(["-f", str(SOURCE), "hpa"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == "HorizontalPodAutoscaler"
    bad = ROOT / "examples" / "invalid" / "min-over-max.yaml"
    assert interop.main(["-f", str(bad), "keda"]) == 1
    assert "minReplicas" in capsys.readouterr().err
