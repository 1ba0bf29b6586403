"""spec.routing.inferencePool: the operator creates and owns an InferencePool and an
HTTPRoute, reports the Gateways' verdict as the InferencePool condition, and skips both,
saying why, where the Inference Extension's CRDs are not installed."""

from __future__ import annotations

import json
from typing import Any

import kmock

from .conftest import ROOT, create, manifest, running_operator, wait_for

NS = "llm"
NAME = "tiny"
ENGINE = "tiny-engine"
POOLS = "inference.networking.k8s.io/v1/inferencepools"
ROUTES = "gateway.networking.k8s.io/v1/httproutes"
LLMD = "kubellm.io/v1alpha1/llmdeployments"


def _current(emulator, resource: str, name: str) -> dict[str, Any] | None:
    key = (kmock.resource(resource), NS, name)
    if key not in emulator.objects or emulator.objects[key].deleted:
        return None
    return emulator.objects[key].raw


def _condition(emulator, kind: str) -> tuple[str, str] | None:
    status = (_current(emulator, LLMD, NAME) or {}).get("status") or {}
    for cond in status.get("conditions") or []:
        if cond["type"] == kind:
            return cond["status"], cond["reason"]
    return None


def _document() -> dict[str, Any]:
    document = manifest(ROOT / "examples" / "tiny-cpu.yaml")
    document["metadata"].update(name=NAME, namespace=NS)
    document["spec"].setdefault("routing", {})["inferencePool"] = {
        "endpointPicker": {"failureMode": "FailOpen"},
        "parentRefs": [{"name": "inference-gateway", "namespace": "gateways"}],
    }
    return document


def _install_gateway_crds(emulator) -> None:
    verbs = {"get", "list", "watch", "create", "patch", "delete"}
    emulator.resources[POOLS] = kmock.ResourceInfo(
        kind="InferencePool", namespaced=True, verbs=verbs, subresources={"status"}
    )
    emulator.resources[ROUTES] = kmock.ResourceInfo(kind="HTTPRoute", namespaced=True, verbs=verbs)


async def test_pool_and_route_are_created_and_the_gateways_verdict_is_reported(
    emulator, api_client
):
    _install_gateway_crds(emulator)
    async with running_operator(emulator, resync_seconds=0.2):
        await create(api_client, _document())
        pool = await wait_for(lambda: _current(emulator, POOLS, ENGINE), what="InferencePool")
        route = await wait_for(lambda: _current(emulator, ROUTES, ENGINE), what="HTTPRoute")
        assert pool["spec"]["endpointPickerRef"] == {
            "group": "", "kind": "Service", "name": "kubellm-epp",
            "port": {"number": 9002}, "failureMode": "FailOpen",
        }  # fmt: skip
        assert pool["spec"]["selector"]["matchLabels"]["kubellm.io/deployment"] == NAME
        owner = pool["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "LLMDeployment" and owner["controller"] is True
        assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
        backend = route["spec"]["rules"][0]["backendRefs"][0]
        assert (backend["kind"], backend["name"]) == ("InferencePool", ENGINE)
        assert await wait_for(lambda: _condition(emulator, "InferencePool")) == (
            "Unknown", "WaitingForGateway",
        )  # fmt: skip
        # The gateway controller writes its verdict on the pool's status.
        verdict = {"status": {"parents": [{
            "parentRef": {"kind": "Gateway", "namespace": "gateways", "name": "inference-gateway"},
            "conditions": [
                {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
                 "lastTransitionTime": "2026-12-01T00:00:00Z"},
                {"type": "ResolvedRefs", "status": "False", "reason": "InvalidExtensionRef",
                 "message": "Service kubellm-epp not found",
                 "lastTransitionTime": "2026-12-01T00:00:00Z"},
            ],
        }]}}  # fmt: skip
        path = f"/apis/{POOLS.rsplit('/', 1)[0]}/namespaces/{NS}/inferencepools/{ENGINE}"
        response = await api_client.patch(
            path, content=json.dumps(verdict),
            headers={"Content-Type": "application/merge-patch+json"},
        )  # fmt: skip
        response.raise_for_status()
        assert await wait_for(
            lambda: _condition(emulator, "InferencePool") == ("False", "NotAccepted"),
            what="the gateway's ResolvedRefs=False surfaced",
        )


async def test_without_the_crds_nothing_is_created_and_the_condition_says_why(emulator, api_client):
    async with running_operator(emulator):
        await create(api_client, _document())
        reason = await wait_for(lambda: _condition(emulator, "InferencePool"))
        assert reason == ("False", "InferenceExtensionNotInstalled")
        assert _current(emulator, POOLS, ENGINE) is None
        assert _current(emulator, "apps/v1/deployments", ENGINE) is not None
