"""The real kopf operator against the API emulator: one behaviour per test.

Each test starts the operator, acts the way a person, the autoscaler or a
Kubernetes controller would (through the emulator's HTTP API, so watch events
flow), and waits for the operator's answer with a deadline.
"""

from __future__ import annotations

from typing import Any

import kmock

from kubellm import api

from .conftest import (
    LLMD,
    ROOT,
    create,
    manifest,
    patch,
    running_operator,
    wait_for,
    writes_over_resyncs,
    writes_since,
)

GPU_EXAMPLE = ROOT / "examples" / "llama-3.1-8b-gpu.yaml"
CPU_EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
CONFIGMAPS = "v1/configmaps"
PDBS = "policy/v1/poddisruptionbudgets"
SECRETS = "v1/secrets"
NS = "llm"
NAME = "llama-8b"
ENGINE = "llama-8b-engine"
LLMD_PATH = f"/apis/{api.API_VERSION}/namespaces/{NS}/{api.PLURAL}/{NAME}"


def current(emulator, resource: str, name: str, ns: str = NS) -> dict[str, Any] | None:
    key = (kmock.resource(resource), ns, name)
    if key not in emulator.objects or emulator.objects[key].deleted:
        return None
    return emulator.objects[key].raw


def llmd_status(emulator, name: str = NAME, ns: str = NS) -> dict[str, Any]:
    return (current(emulator, LLMD, name, ns) or {}).get("status") or {}


def condition(emulator, kind: str, name: str = NAME, ns: str = NS) -> tuple[str, str] | None:
    for cond in llmd_status(emulator, name, ns).get("conditions") or []:
        if cond["type"] == kind:
            return cond["status"], cond["reason"]
    return None


def event_reasons(emulator) -> list[str]:
    return [
        r.data.get("reason")
        for r in list(emulator)
        if r.method.value == "POST" and r.resource and r.resource.plural == "events"
    ]


def handled_by_kopf(emulator, name: str = NAME, ns: str = NS) -> bool:
    meta = current(emulator, LLMD, name, ns)["metadata"]
    return "kubellm.io/finalizer" in meta.get("finalizers", []) and (
        "kopf.zalando.org/last-handled-configuration" in meta.get("annotations", {})
    )


def spec_hash(deployment: dict[str, Any]) -> str:
    return deployment["spec"]["template"]["metadata"]["annotations"]["kubellm.io/spec-hash"]


async def make_secret(api_client, name: str = "fallback-api") -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NS},
        "data": {"api-key": "c2VjcmV0"},
    }
    (await api_client.post(f"/api/v1/namespaces/{NS}/secrets", json=secret)).raise_for_status()


async def rolled_out(api_client, emulator, ready: int) -> None:
    """Do what the Deployment controller does when `ready` engine pods pass readiness."""
    deployment = current(emulator, DEPLOYMENTS, ENGINE)
    await patch(
        api_client,
        f"/apis/apps/v1/namespaces/{NS}/deployments/{ENGINE}/status",
        {
            "status": {
                "observedGeneration": deployment["metadata"].get("generation", 1),
                "replicas": deployment["spec"]["replicas"],
                "readyReplicas": ready,
                "updatedReplicas": deployment["spec"]["replicas"],
                "availableReplicas": ready,
            }
        },
    )


async def test_create_makes_children_with_owner_references_and_status(emulator, api_client):
    await make_secret(api_client)
    async with running_operator(emulator):
        await create(api_client, manifest(GPU_EXAMPLE))
        await wait_for(lambda: llmd_status(emulator).get("conditions"), what="status")
        for resource, name in [
            (CONFIGMAPS, "llama-8b-engine-spec"),
            (DEPLOYMENTS, ENGINE),
            (SERVICES, ENGINE),
            (PDBS, ENGINE),
        ]:
            child = await wait_for(lambda r=resource, n=name: current(emulator, r, n), what=name)
            (owner,) = child["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["name"], owner["uid"]) == (api.KIND, NAME, "uid-1")
            assert child["metadata"]["labels"]["kubellm.io/deployment"] == NAME
        status = llmd_status(emulator)
        assert status["observedGeneration"] == 1
        assert status["selector"] == (
            "app.kubernetes.io/instance=llama-8b,app.kubernetes.io/name=kubellm-engine,"
            "kubellm.io/deployment=llama-8b"
        )
        assert status["capacity"]["maxConcurrentSequences"] > 0
        assert condition(emulator, "Degraded") == ("False", "AsExpected")
        assert condition(emulator, "Ready")[0] == "False"


async def test_second_reconcile_of_an_unchanged_deployment_writes_nothing(emulator, api_client):
    await make_secret(api_client)
    async with running_operator(emulator, resync_seconds=0.2):
        await create(api_client, manifest(GPU_EXAMPLE))
        await wait_for(lambda: current(emulator, PDBS, ENGINE), what="children")
        await rolled_out(api_client, emulator, ready=2)
        await wait_for(lambda: condition(emulator, "Ready") == ("True", "AllReplicasReady"))
        # Steady state: kopf's own bookkeeping and the Ready event are written.
        await wait_for(lambda: handled_by_kopf(emulator), what="kopf's finalizer and annotation")
        await wait_for(lambda: "Ready" in event_reasons(emulator), what="a Ready event")
        # Three more passes of the resync timer: each reads the object fresh.
        assert await writes_over_resyncs(emulator, LLMD_PATH) == []


async def test_spec_change_rolls_the_template_and_status_generation_follows(emulator, api_client):
    async with running_operator(emulator):
        await create(api_client, manifest(GPU_EXAMPLE))
        before = await wait_for(lambda: current(emulator, DEPLOYMENTS, ENGINE))
        old_hash = spec_hash(before)
        await wait_for(lambda: llmd_status(emulator).get("observedGeneration") == 1)
        await patch(api_client, LLMD_PATH, {"spec": {"engine": {"maxModelLen": 4096}}})
        after = await wait_for(
            lambda: (d := current(emulator, DEPLOYMENTS, ENGINE)) and spec_hash(d) != old_hash and d
        )
        configmap = current(emulator, CONFIGMAPS, "llama-8b-engine-spec")
        assert '"maxModelLen": 4096' in configmap["data"]["llmdeployment.json"]
        assert after["spec"]["replicas"] == 2
        await wait_for(lambda: llmd_status(emulator).get("observedGeneration") == 2)


async def test_scale_subresource_drives_replicas_and_autoscaler_status_survives(
    emulator, api_client
):
    async with running_operator(emulator):
        await create(api_client, manifest(GPU_EXAMPLE))
        await wait_for(lambda: current(emulator, DEPLOYMENTS, ENGINE))
        old_hash = spec_hash(current(emulator, DEPLOYMENTS, ENGINE))
        autoscaler = {"desiredReplicas": 5, "reason": "kv-cache 0.93 > 0.80"}
        await patch(api_client, f"{LLMD_PATH}/status", {"status": {"autoscaler": autoscaler}})
        await patch(api_client, f"{LLMD_PATH}/scale", {"spec": {"replicas": 5}})
        deployment = await wait_for(
            lambda: (
                (d := current(emulator, DEPLOYMENTS, ENGINE)) and d["spec"]["replicas"] == 5 and d
            )
        )
        assert spec_hash(deployment) == old_hash  # scaling never restarts engines
        await wait_for(lambda: llmd_status(emulator).get("observedGeneration") == 2)
        assert llmd_status(emulator)["autoscaler"] == autoscaler


async def test_hand_edits_and_deletions_of_children_are_put_back(emulator, api_client):
    async with running_operator(emulator):
        await create(api_client, manifest(GPU_EXAMPLE))
        await wait_for(lambda: current(emulator, SERVICES, ENGINE))
        await patch(
            api_client,
            f"/api/v1/namespaces/{NS}/services/{ENGINE}",
            {"spec": {"ports": [{"name": "http", "port": 1234}]}},
        )
        await wait_for(
            lambda: current(emulator, SERVICES, ENGINE)["spec"]["ports"][0]["port"] == 8000,
            what="the Service port restored",
        )
        await patch(
            api_client,
            f"/apis/apps/v1/namespaces/{NS}/deployments/{ENGINE}",
            {"spec": {"template": {"spec": {"priorityClassName": "cheap"}}}},
        )
        await wait_for(
            lambda: (
                current(emulator, DEPLOYMENTS, ENGINE)["spec"]["template"]["spec"][
                    "priorityClassName"
                ]
                == "llm-serving"
            ),
            what="the Deployment restored",
        )
        response = await api_client.delete(
            f"/api/v1/namespaces/{NS}/configmaps/llama-8b-engine-spec"
        )
        response.raise_for_status()
        await wait_for(
            lambda: current(emulator, CONFIGMAPS, "llama-8b-engine-spec"),
            what="the ConfigMap recreated",
        )


async def test_child_deployment_status_flows_into_conditions(emulator, api_client):
    await make_secret(api_client)
    async with running_operator(emulator):
        await create(api_client, manifest(GPU_EXAMPLE))
        await wait_for(lambda: current(emulator, DEPLOYMENTS, ENGINE))
        await rolled_out(api_client, emulator, ready=1)
        await wait_for(lambda: llmd_status(emulator).get("readyReplicas") == 1)
        assert condition(emulator, "Ready") == ("False", "ReplicasNotReady")
        assert condition(emulator, "Progressing") == ("True", "WaitingForReplicas")
        await rolled_out(api_client, emulator, ready=2)
        await wait_for(lambda: condition(emulator, "Ready") == ("True", "AllReplicasReady"))
        assert condition(emulator, "Progressing") == ("False", "RolloutComplete")
        assert llmd_status(emulator)["replicas"] == 2
        await wait_for(lambda: "Ready" in event_reasons(emulator), what="a Ready event")


async def test_missing_fallback_secret_degrades_until_it_exists(emulator, api_client):
    async with running_operator(emulator, resync_seconds=0.2):
        await create(api_client, manifest(GPU_EXAMPLE))
        await wait_for(lambda: condition(emulator, "Degraded") == ("True", "FallbackSecretMissing"))
        message = next(
            c["message"] for c in llmd_status(emulator)["conditions"] if c["type"] == "Degraded"
        )
        assert "llm/fallback-api" in message and "apiKeySecretRef" in message
        await make_secret(api_client)
        await wait_for(lambda: condition(emulator, "Degraded") == ("False", "AsExpected"))


async def test_unrealisable_spec_degrades_without_touching_other_deployments(emulator, api_client):
    async with running_operator(emulator):
        bad = manifest(CPU_EXAMPLE, uid="uid-bad")
        bad["metadata"]["name"] = "bad"
        bad["spec"]["model"]["source"] = "s3://bucket/model"
        await create(api_client, bad)
        await create(api_client, manifest(CPU_EXAMPLE, uid="uid-good"))
        await wait_for(
            lambda: (
                condition(emulator, "Degraded", "bad", "default")
                == ("True", "UnsupportedModelSource")
            )
        )
        await wait_for(lambda: current(emulator, DEPLOYMENTS, "tiny-engine", "default"))
        assert current(emulator, DEPLOYMENTS, "bad-engine", "default") is None


async def test_transient_api_errors_are_retried(emulator, api_client):
    failures = {"left": 2}

    def flaky(request: Any) -> bool:
        hit = request.method.value == "GET" and request.url.path.endswith(f"/deployments/{ENGINE}")
        if hit and failures["left"] > 0:
            failures["left"] -= 1
            return True
        return False

    emulator[flaky] << 503
    async with running_operator(emulator):
        await create(api_client, manifest(GPU_EXAMPLE))
        await wait_for(lambda: current(emulator, DEPLOYMENTS, ENGINE), what="created after retries")
        assert failures["left"] == 0


async def test_podmonitor_is_created_when_its_crd_is_installed(emulator, api_client):
    emulator.resources["monitoring.coreos.com/v1/podmonitors"] = kmock.ResourceInfo(
        kind="PodMonitor", namespaced=True, verbs={"get", "list", "watch", "create", "patch"}
    )
    async with running_operator(emulator):
        await create(api_client, manifest(GPU_EXAMPLE))
        monitor = await wait_for(
            lambda: current(emulator, "monitoring.coreos.com/v1/podmonitors", ENGINE)
        )
        assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"


async def test_delete_releases_the_object_and_the_operator_stops_cleanly(emulator, api_client):
    async with running_operator(emulator):
        await create(api_client, manifest(GPU_EXAMPLE))
        await wait_for(
            lambda: (
                "kubellm.io/finalizer"
                in current(emulator, LLMD, NAME)["metadata"].get("finalizers", [])
            )
        )
        await wait_for(lambda: current(emulator, DEPLOYMENTS, ENGINE))
        (await api_client.delete(LLMD_PATH)).raise_for_status()
        await wait_for(lambda: current(emulator, LLMD, NAME) is None, what="finalizer released")
        mark = len(list(emulator))
    # running_operator asserted that kopf exited within its deadline, without an error.
    assert [w for w in writes_since(emulator, mark) if "/events" not in w] == []


async def test_children_the_spec_no_longer_wants_are_deleted(emulator, api_client):
    path = f"/apis/{api.API_VERSION}/namespaces/default/{api.PLURAL}/tiny"
    async with running_operator(emulator):
        await create(api_client, manifest(CPU_EXAMPLE))
        await wait_for(lambda: current(emulator, DEPLOYMENTS, "tiny-engine", "default"))
        assert current(emulator, PDBS, "tiny-engine", "default") is None  # one replica: no PDB
        await patch(api_client, f"{path}/scale", {"spec": {"replicas": 3}})
        await wait_for(lambda: current(emulator, PDBS, "tiny-engine", "default"), what="a PDB")
        await patch(api_client, f"{path}/scale", {"spec": {"replicas": 1}})
        await wait_for(
            lambda: current(emulator, PDBS, "tiny-engine", "default") is None,
            what="the PDB deleted",
        )
        assert current(emulator, DEPLOYMENTS, "tiny-engine", "default")["spec"]["replicas"] == 1


async def test_engine_pod_problems_surface_as_degraded(emulator, api_client):
    await make_secret(api_client)
    labels = {
        "app.kubernetes.io/name": "kubellm-engine",
        "app.kubernetes.io/instance": NAME,
        "kubellm.io/deployment": NAME,
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{ENGINE}-abc", "namespace": NS, "labels": labels},
        "status": {
            "containerStatuses": [
                {
                    "name": "engine",
                    "image": "ghcr.io/kubellm/engine:0.1.0",
                    "state": {"waiting": {"reason": "ImagePullBackOff", "message": "denied"}},
                }
            ]
        },
    }
    (await api_client.post(f"/api/v1/namespaces/{NS}/pods", json=pod)).raise_for_status()
    async with running_operator(emulator, resync_seconds=0.2):
        await create(api_client, manifest(GPU_EXAMPLE))
        await wait_for(lambda: condition(emulator, "Degraded") == ("True", "ImagePullFailed"))
        assert condition(emulator, "Ready") == ("False", "ImagePullFailed")
        await wait_for(lambda: "ImagePullFailed" in event_reasons(emulator), what="a Warning")
