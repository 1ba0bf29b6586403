"""The Inference Extension objects kubellm renders, the chart's (epp.*) and the operator's
(`kubellm render`), checked against the InferencePool (inference.networking.k8s.io/v1) and
HTTPRoute (gateway.networking.k8s.io/v1) CRD schemas in tests/helm/crds/, and the EPP's
Deployment, Service and RBAC against Kubernetes' own schemas."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.fixtures.crd_validation import validate
from tests.helm.chart import ROOT, render_values

CRDS = Path(__file__).parent / "crds"
POOL_CRD = yaml.safe_load((CRDS / "inferencepools.inference.networking.k8s.io.yaml").read_text())
ROUTE_CRD = yaml.safe_load((CRDS / "httproutes.gateway.networking.k8s.io.yaml").read_text())
CRD_OF = {"InferencePool": POOL_CRD, "HTTPRoute": ROUTE_CRD}

EPP_VALUES: dict[str, Any] = {
    "epp": {
        "enabled": True,
        "inferencePools": [
            {
                "name": "byo-vllm",
                "matchLabels": {"app": "vllm"},
                "targetPort": 8000,
                "failureMode": "FailOpen",
                "parentRefs": [{"name": "inference-gateway", "namespace": "gateway-system"}],
                "modelName": "llama",
            }
        ],
    },
    "metrics": {"serviceMonitor": {"enabled": True}},
}


def _errors(obj: dict[str, Any]) -> list[str]:
    return validate(CRD_OF[obj["kind"]], obj, "v1")[1]


def _chart_objects() -> list[dict[str, Any]]:
    return render_values(EPP_VALUES)


def test_chart_renders_the_epp_and_its_pools_valid_against_the_crds() -> None:
    objects = _chart_objects()
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    service = by_kind["Service", "kubellm-epp"]
    pool = by_kind["InferencePool", "byo-vllm"]
    route = by_kind["HTTPRoute", "byo-vllm"]
    assert _errors(pool) == [] and _errors(route) == []
    picker = pool["spec"]["endpointPickerRef"]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert (picker["name"], picker["port"]["number"]) == ("kubellm-epp", grpc["port"])
    assert picker["failureMode"] == "FailOpen"
    match = route["spec"]["rules"][0]["matches"][0]
    assert match["headers"] == [{"type": "Exact", "name": "X-Gateway-Model-Name", "value": "llama"}]
    args = by_kind["Deployment", "kubellm-epp"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "epp" and "--grpc-port=9002" in args
    assert "--fallback-forwarder=kubellm-gateway.kubellm-system.svc:80" in args
    assert ("ServiceMonitor", "kubellm-epp") in by_kind


@pytest.mark.parametrize("kind", ["Deployment", "Service", "ServiceAccount", "ClusterRole",
                                  "ClusterRoleBinding"])  # fmt: skip
def test_epp_objects_pass_kubernetes_schemas(kind: str) -> None:
    found = [o for o in _chart_objects() if o["kind"] == kind and "epp" in o["metadata"]["name"]]
    assert found
    for obj in found:
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_kubellm_render_shows_the_pool_and_route_valid_against_the_crds() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kubellm.cli", "render", "-f",
         str(ROOT / "examples" / "inference-gateway.yaml")],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    objects = {o["kind"]: o for o in yaml.safe_load_all(result.stdout)}
    assert {"InferencePool", "HTTPRoute"} <= set(objects)
    for kind in ("InferencePool", "HTTPRoute"):
        assert _errors(objects[kind]) == [], kind
    engine = objects["Service"]
    selector = objects["InferencePool"]["spec"]["selector"]["matchLabels"]
    assert selector == engine["spec"]["selector"]  # the pool holds exactly the engine pods


def test_the_crd_schemas_reject_what_a_gateway_would_refuse() -> None:
    """The checks can fail: a bad failure mode, a Service ref without a port, an unknown
    field each give an error naming the field."""
    pool = next(o for o in _chart_objects() if o["kind"] == "InferencePool")
    bad = yaml.safe_load(yaml.safe_dump(pool))
    bad["spec"]["endpointPickerRef"]["failureMode"] = "Open"
    assert any("failureMode" in e for e in _errors(bad))
    bad = yaml.safe_load(yaml.safe_dump(pool))
    del bad["spec"]["endpointPickerRef"]["port"]
    assert any("port is required" in e for e in _errors(bad))
    bad = yaml.safe_load(yaml.safe_dump(pool))
    bad["spec"]["targetPortNumber"] = 8000  # the pre-v1 field name
    assert any("targetPortNumber: unknown field" in e for e in _errors(bad))
