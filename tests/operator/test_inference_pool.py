"""spec.routing.inferencePool: the operator creates and owns an InferencePool, the pool's
own endpoint picker (`kubellm epp --pool-name`, with a Role reading its namespace only) and an
HTTPRoute, reports the Gateways' verdict as the InferencePool condition, and skips them all,
saying why, where the Inference Extension's CRDs are not installed."""

from __future__ import annotations

import json
from typing import Any

import kmock
from kubellm.operator import builders

from .conftest import ROOT, create, manifest, patch, running_operator, wait_for

NS = "llm"
NAME = "tiny"
ENGINE = "tiny-engine"
PICKER = "tiny-epp"
POOLS = "inference.networking.k8s.io/v1/inferencepools"
ROUTES = "gateway.networking.k8s.io/v1/httproutes"
LLMD = "kubellm.io/v1alpha1/llmdeployments"
LLMD_PATH = f"/apis/kubellm.io/v1alpha1/namespaces/{NS}/llmdeployments/{NAME}"
# The pool's own picker: every object, by resource.
PICKER_RESOURCES = (
    "v1/serviceaccounts",
    "rbac.authorization.k8s.io/v1/roles",
    "rbac.authorization.k8s.io/v1/rolebindings",
    "apps/v1/deployments",
    "v1/services",
)


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
            "group": "", "kind": "Service", "name": PICKER,
            "port": {"number": 9002}, "failureMode": "FailOpen",
        }  # fmt: skip
        assert pool["spec"]["selector"]["matchLabels"]["kubellm.io/deployment"] == NAME
        owner = pool["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "LLMDeployment" and owner["controller"] is True
        assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
        backend = route["spec"]["rules"][0]["backendRefs"][0]
        assert (backend["kind"], backend["name"]) == ("InferencePool", ENGINE)
        # The whole request's bound, as the gateway's (totalSeconds unset: 600 s).
        assert route["spec"]["rules"][0]["timeouts"] == {"request": "10m"}
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
                 "message": "Service tiny-epp not found",
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
        assert all(_current(emulator, r, PICKER) is None for r in PICKER_RESOURCES)


def _picker_objects(emulator) -> dict[str, dict[str, Any] | None]:
    return {resource: _current(emulator, resource, PICKER) for resource in PICKER_RESOURCES}


async def test_each_pool_gets_its_own_picker_owned_by_the_deployment(emulator, api_client):
    """The picker serves this pool alone (`--pool-name`), reads this namespace alone (a Role,
    not a ClusterRole), and goes with the LLMDeployment (owner references)."""
    _install_gateway_crds(emulator)
    async with running_operator(emulator, resync_seconds=0.2):
        await create(api_client, _document())
        await wait_for(lambda: all(_picker_objects(emulator).values()), what="the picker")
        objects = _picker_objects(emulator)
        for resource, obj in objects.items():
            (owner,) = obj["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
                "LLMDeployment", NAME, "uid-1", True,
            ), resource  # fmt: skip
        deployment = objects["apps/v1/deployments"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        command = container["command"]
        assert command[:2] == ["kubellm", "epp"]
        assert {f"--pool-name={ENGINE}", f"--pool-namespace={NS}", f"--namespace={NS}"} <= set(
            command
        )
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == PICKER
        role = objects["rbac.authorization.k8s.io/v1/roles"]
        assert role["metadata"]["namespace"] == NS
        assert role["rules"] == [dict(rule) for rule in builders.PICKER_RULES]
        binding = objects["rbac.authorization.k8s.io/v1/rolebindings"]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": PICKER,
        }  # fmt: skip
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": PICKER, "namespace": NS}]
        service = objects["v1/services"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        engine_selector = _current(emulator, "v1/services", ENGINE)["spec"]["selector"]
        assert not engine_selector.items() <= pod_labels.items()  # never an engine endpoint
        pool = await wait_for(lambda: _current(emulator, POOLS, ENGINE), what="InferencePool")
        grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert (pool["spec"]["endpointPickerRef"]["name"], grpc["port"]) == (PICKER, 9002)


async def test_a_picker_change_updates_it_and_dropping_the_pool_deletes_it(emulator, api_client):
    _install_gateway_crds(emulator)
    async with running_operator(emulator, resync_seconds=0.2):
        await create(api_client, _document())
        await wait_for(lambda: all(_picker_objects(emulator).values()), what="the picker")
        await patch(api_client, LLMD_PATH, {"spec": {"routing": {"inferencePool": {
            "endpointPicker": {"port": 9100, "replicas": 2},
        }}}})  # fmt: skip

        def moved() -> bool:
            service = _current(emulator, "v1/services", PICKER)
            deployment = _current(emulator, "apps/v1/deployments", PICKER)
            pool = _current(emulator, POOLS, ENGINE)
            (container,) = deployment["spec"]["template"]["spec"]["containers"]
            return (
                any(p["port"] == 9100 for p in service["spec"]["ports"])
                and "--grpc-port=9100" in container["command"]
                and deployment["spec"]["replicas"] == 2
                and pool["spec"]["endpointPickerRef"]["port"] == {"number": 9100}
            )

        await wait_for(moved, what="the picker, its Service and the pool on port 9100")
        await patch(api_client, LLMD_PATH, {"spec": {"routing": {"inferencePool": None}}})
        await wait_for(
            lambda: (
                not any(_picker_objects(emulator).values())
                and _current(emulator, POOLS, ENGINE) is None
                and _current(emulator, ROUTES, ENGINE) is None
            ),
            what="the picker, the pool and the route deleted",
        )
        assert _current(emulator, "apps/v1/deployments", ENGINE) is not None


async def test_a_named_or_shared_picker_is_used_and_none_is_run(emulator, api_client):
    """The spec's endpointPicker.name, or the operator's --shared-endpoint-picker, names an
    existing picker: the pool points there and the operator runs none of its own."""
    _install_gateway_crds(emulator)
    shared = builders.PickerOptions(shared="kubellm-epp")
    async with running_operator(emulator, resync_seconds=0.2, picker=shared):
        await create(api_client, _document())
        pool = await wait_for(lambda: _current(emulator, POOLS, ENGINE), what="InferencePool")
        assert pool["spec"]["endpointPickerRef"]["name"] == "kubellm-epp"
        await patch(api_client, LLMD_PATH, {"spec": {"routing": {"inferencePool": {
            "endpointPicker": {"name": "team-a-epp"},
        }}}})  # fmt: skip
        await wait_for(
            lambda: (
                _current(emulator, POOLS, ENGINE)["spec"]["endpointPickerRef"]["name"]
                == "team-a-epp"
            ),
            what="the pool on the named picker",
        )
        assert not any(_picker_objects(emulator).values())


async def test_a_tenants_secret_of_the_pools_namespace_is_mounted_and_rolls_the_picker(
    emulator, api_client
):
    """endpointPicker.tenantsSecretRef: until the Secret exists the LLMDeployment says so
    (TenantsSecretMissing) and the picker mounts it anyway (its pods wait: no picker
    without the tenants it was asked for); once it exists the picker runs `--tenants` with
    the quota store the operator was given, its pods carry the file's checksum, and a
    change of the file changes the checksum (the Deployment rolls)."""
    import base64
    import hashlib

    _install_gateway_crds(emulator)
    picker = builders.PickerOptions(quota_redis="redis://redis.sys:6379/0")
    document = _document()
    document["spec"]["routing"]["inferencePool"]["endpointPicker"]["tenantsSecretRef"] = {
        "name": "team-tenants"
    }

    def template() -> dict[str, Any]:
        return _current(emulator, "apps/v1/deployments", PICKER)["spec"]["template"]

    def checksum() -> str | None:
        return template()["metadata"]["annotations"].get("checksum/tenants")

    async def put(text: str, create_it: bool) -> str:
        secret = {
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "team-tenants", "namespace": NS},
            "data": {"tenants.yaml": base64.b64encode(text.encode()).decode()},
        }  # fmt: skip
        path = f"/api/v1/namespaces/{NS}/secrets"
        if create_it:
            (await api_client.post(path, json=secret)).raise_for_status()
        else:
            await patch(api_client, f"{path}/team-tenants", {"data": secret["data"]})
        return secret["data"]["tenants.yaml"]

    async with running_operator(emulator, resync_seconds=0.2, picker=picker):
        await create(api_client, document)
        await wait_for(
            lambda: _condition(emulator, "Degraded") == ("True", "TenantsSecretMissing"),
            what="TenantsSecretMissing",
        )
        message = next(
            c["message"]
            for c in _current(emulator, LLMD, NAME)["status"]["conditions"]
            if c["type"] == "Degraded"
        )
        assert "llm/team-tenants" in message and "tenants.yaml" in message
        await wait_for(lambda: _current(emulator, "apps/v1/deployments", PICKER), what="picker")
        assert checksum() is None
        spec = template()["spec"]
        assert {"name": "tenants", "secret": {"secretName": "team-tenants", "items": [
            {"key": "tenants.yaml", "path": "tenants.yaml"}]}} in spec["volumes"]  # fmt: skip
        (container,) = spec["containers"]
        assert {"name": "tenants", "mountPath": "/etc/kubellm/tenants", "readOnly": True} in (
            container["volumeMounts"]
        )
        assert {
            "--tenants=/etc/kubellm/tenants/tenants.yaml",
            "--quota-redis=redis://redis.sys:6379/0",
        } <= set(container["command"])

        first = await put("tenants: [{name: a, apiKeys: []}]\n", create_it=True)
        want = hashlib.sha256(first.encode()).hexdigest()
        await wait_for(lambda: checksum() == want, what="the file's checksum on the pods")
        await wait_for(
            lambda: _condition(emulator, "Degraded") != ("True", "TenantsSecretMissing"),
            what="the problem cleared",
        )
        second = await put("tenants: [{name: b, apiKeys: []}]\n", create_it=False)
        want = hashlib.sha256(second.encode()).hexdigest()
        await wait_for(lambda: checksum() == want, what="a new checksum: the pods roll")
