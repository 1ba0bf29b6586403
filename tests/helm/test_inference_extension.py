"""The Inference Extension objects kubellm renders, the chart's (epp.*) and the operator's
(`kubellm render`), checked against the InferencePool (inference.networking.k8s.io/v1) and
HTTPRoute (gateway.networking.k8s.io/v1) CRD schemas in tests/helm/crds/, and the EPP's
Deployment, Service and RBAC against Kubernetes' own schemas."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kubellm.contracts import POOL_HEADER
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


def _pool_header(route: dict[str, Any]) -> str:
    """The pool a route names to the picker (issue 39.22: a shared picker picks in it)."""
    (rule,) = route["spec"]["rules"]
    (filtered,) = rule["filters"]
    ((header,),) = [filtered["requestHeaderModifier"]["set"]]
    assert header["name"] == POOL_HEADER
    return header["value"]


def _chart_objects() -> list[dict[str, Any]]:
    return render_values(EPP_VALUES)


def test_chart_renders_the_epp_and_its_pools_valid_against_the_crds() -> None:
    objects = _chart_objects()
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    service = by_kind["Service", "kubellm-epp"]
    pool = by_kind["InferencePool", "byo-vllm"]
    route = by_kind["HTTPRoute", "byo-vllm"]
    assert _errors(pool) == [] and _errors(route) == []
    assert _pool_header(route).endswith("/byo-vllm")  # a shared picker picks in this pool
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
    rendered = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(result.stdout)}
    pool, route = (
        rendered["InferencePool", "tiny-gw-engine"],
        rendered["HTTPRoute", "tiny-gw-engine"],
    )
    assert _errors(pool) == [] and _errors(route) == []
    assert _pool_header(route).endswith("/tiny-gw-engine")
    engine = rendered["Service", "tiny-gw-engine"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == engine["spec"]["selector"]  # the pool holds exactly the engine pods
    # The pool's own picker, shown as the operator creates it by default.
    picker = rendered["Service", "tiny-gw-epp"]
    assert pool["spec"]["endpointPickerRef"]["name"] == picker["metadata"]["name"]
    assert route["spec"]["rules"][0]["timeouts"] == {"request": "10m"}
    for kind in ("ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"):
        kubernetes_validate.validate(rendered[kind, "tiny-gw-epp"], "1.33", strict=True)


@pytest.mark.parametrize("total", [None, 0.001, 2.5, 90, 600, 3661.5, 86400])
def test_the_operators_route_timeouts_are_valid_against_the_crd(total: float | None) -> None:
    """Every totalSeconds the LLMDeployment CRD accepts gives a request timeout the HTTPRoute
    CRD accepts (pattern and CEL rule), as a Duration of the same length, rounded up to 1 ms."""
    from kubellm.operator import builders

    from kubellm import manifests

    spec: dict[str, Any] = {
        "model": {"source": "hf://org/m"},
        "routing": {"inferencePool": {"parentRefs": [{"name": "gw"}]}},
    }
    if total is not None:
        spec["routing"]["timeouts"] = {"totalSeconds": total}
    document = {"apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
                "metadata": {"name": "m", "namespace": "ns"}, "spec": spec}  # fmt: skip
    llmd = manifests.parse(document)
    route = builders.http_route(llmd, builders.Options(inference_pool=True, http_route=True))
    assert _errors(route) == []
    request = route["spec"]["rules"][0]["timeouts"]["request"]
    seconds = sum(int(n) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
                  for n, unit in re.findall(r"([0-9]+)(h|ms|m|s)", request))  # fmt: skip
    assert seconds == pytest.approx(max(0.001, total or 600.0), abs=0.001)


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
    route = next(o for o in _chart_objects() if o["kind"] == "HTTPRoute")
    for timeouts, error in [
        ({"request": "1.5s"}, "timeouts.request: '1.5s' does not match"),  # no fractions
        ({"request": "600"}, "timeouts.request: '600' does not match"),  # a unit is required
        ({"request": "1s", "backendRequest": "2s"}, "cannot be longer than request timeout"),
    ]:
        bad = yaml.safe_load(yaml.safe_dump(route))
        bad["spec"]["rules"][0]["timeouts"] = timeouts
        assert any(error in e for e in _errors(bad)), (timeouts, _errors(bad))
