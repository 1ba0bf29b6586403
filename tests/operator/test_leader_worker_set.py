"""A replica that spans pods (spec.resources.nodes > 1) runs as a LeaderWorkerSet group:
the real kopf operator against the API emulator, with the LWS resource registered as its
CRD would register it (the emulator runs no LWS controller: the tests write its status)."""

from __future__ import annotations

import kmock

from kubellm import api

from . import test_operator as single
from .conftest import ROOT, create, manifest, patch, running_operator, wait_for, writes_over_resyncs
from .test_operator import DEPLOYMENTS, PDBS, SERVICES, current, event_reasons

EXAMPLE = ROOT / "examples" / "llama-3.1-405b-multinode.yaml"
LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
NS = "llm"
NAME = "llama-405b"
GROUPS = "llama-405b-lws"
ENGINE = "llama-405b-engine"
LLMD_PATH = f"/apis/{api.API_VERSION}/namespaces/{NS}/{api.PLURAL}/{NAME}"
LWS_PATH = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets/{GROUPS}"


def llmd_status(emulator) -> dict:
    return single.llmd_status(emulator, NAME, NS)


def condition(emulator, kind: str) -> tuple[str, str] | None:
    return single.condition(emulator, kind, NAME, NS)


def handled_by_kopf(emulator) -> bool:
    return single.handled_by_kopf(emulator, NAME, NS)


def install_lws(emulator) -> None:
    emulator.resources[LWS] = kmock.ResourceInfo(
        kind="LeaderWorkerSet",
        singular="leaderworkerset",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        shortnames={"lws"},
        subresources={"status", "scale"},
    )


def template_hash(lws: dict) -> str:
    template = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    return template["metadata"]["annotations"]["kubellm.io/spec-hash"]


async def groups_ready(api_client, emulator, ready: int) -> None:
    """Do what the LeaderWorkerSet controller does when `ready` groups are ready."""
    lws = current(emulator, LWS, GROUPS)
    replicas = lws["spec"]["replicas"]
    status = {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas}
    await patch(api_client, f"{LWS_PATH}/status", {"status": status})


async def test_a_two_node_replica_creates_a_leader_worker_set_and_no_deployment(
    emulator, api_client
):
    install_lws(emulator)
    async with running_operator(emulator):
        await create(api_client, manifest(EXAMPLE))
        lws = await wait_for(lambda: current(emulator, LWS, GROUPS), what="the LeaderWorkerSet")
        await wait_for(lambda: current(emulator, SERVICES, ENGINE), what="the Service")
        await wait_for(lambda: llmd_status(emulator).get("conditions"), what="status")
        assert current(emulator, DEPLOYMENTS, ENGINE) is None
        assert lws["spec"]["replicas"] == 1
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        (owner,) = lws["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == (api.KIND, NAME)
        # the gateway's endpoints (the Service's EndpointSlices) are the leaders
        service = current(emulator, SERVICES, ENGINE)
        assert service["spec"]["selector"]["kubellm.io/role"] == "leader"
        assert "kubellm.io/role=leader" in llmd_status(emulator)["selector"]


async def test_scaling_changes_the_groups_and_status_follows_the_leader_worker_set(
    emulator, api_client
):
    install_lws(emulator)
    async with running_operator(emulator):
        await create(api_client, manifest(EXAMPLE))
        await wait_for(lambda: current(emulator, LWS, GROUPS), what="the LeaderWorkerSet")
        old_hash = template_hash(current(emulator, LWS, GROUPS))
        await patch(api_client, f"{LLMD_PATH}/scale", {"spec": {"replicas": 3}})
        lws = await wait_for(
            lambda: (x := current(emulator, LWS, GROUPS)) and x["spec"]["replicas"] == 3 and x,
            what="3 groups",
        )
        assert template_hash(lws) == old_hash  # scaling never restarts a group
        await groups_ready(api_client, emulator, ready=2)
        await wait_for(lambda: llmd_status(emulator).get("readyReplicas") == 2, what="2 ready")
        assert condition(emulator, "Ready")[0] == "False"
        await groups_ready(api_client, emulator, ready=3)
        await wait_for(lambda: condition(emulator, "Ready") == ("True", "AllReplicasReady"))
        assert llmd_status(emulator)["replicas"] == 3
        assert current(emulator, PDBS, ENGINE) is not None  # 3 groups: one disrupted at a time


async def test_a_spec_change_rolls_the_groups(emulator, api_client):
    install_lws(emulator)
    async with running_operator(emulator):
        await create(api_client, manifest(EXAMPLE))
        before = await wait_for(lambda: current(emulator, LWS, GROUPS))
        await wait_for(lambda: llmd_status(emulator).get("observedGeneration") == 1)
        await patch(api_client, LLMD_PATH, {"spec": {"engine": {"maxModelLen": 4096}}})
        after = await wait_for(
            lambda: (
                (x := current(emulator, LWS, GROUPS))
                and template_hash(x) != template_hash(before)
                and x
            ),
            what="a new template",
        )
        worker = after["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        assert worker["metadata"]["annotations"]["kubellm.io/spec-hash"] == template_hash(after)
        await wait_for(lambda: llmd_status(emulator).get("observedGeneration") == 2)


async def test_an_unchanged_multi_node_deployment_costs_zero_writes(emulator, api_client):
    install_lws(emulator)
    async with running_operator(emulator, resync_seconds=0.2):
        await create(api_client, manifest(EXAMPLE))
        await wait_for(lambda: current(emulator, LWS, GROUPS), what="the LeaderWorkerSet")
        await groups_ready(api_client, emulator, ready=1)
        await wait_for(lambda: condition(emulator, "Ready") == ("True", "AllReplicasReady"))
        await wait_for(lambda: handled_by_kopf(emulator), what="kopf's finalizer and annotation")
        await wait_for(lambda: "Ready" in event_reasons(emulator), what="a Ready event")
        assert await writes_over_resyncs(emulator, LLMD_PATH) == []


async def test_without_the_leader_worker_set_crd_the_spec_is_degraded_and_nothing_runs(
    emulator, api_client
):
    async with running_operator(emulator):
        await create(api_client, manifest(EXAMPLE))
        await wait_for(
            lambda: condition(emulator, "Degraded") == ("True", "LeaderWorkerSetMissing"),
            what="Degraded LeaderWorkerSetMissing",
        )
        assert current(emulator, DEPLOYMENTS, ENGINE) is None
        message = next(
            c["message"] for c in llmd_status(emulator)["conditions"] if c["type"] == "Degraded"
        )
        assert "spec.resources.nodes" in message and "LeaderWorkerSet" in message


async def test_going_back_to_one_node_replaces_the_groups_with_a_deployment(emulator, api_client):
    install_lws(emulator)
    async with running_operator(emulator):
        await create(api_client, manifest(EXAMPLE))
        await wait_for(lambda: current(emulator, LWS, GROUPS), what="the LeaderWorkerSet")
        await patch(
            api_client,
            LLMD_PATH,
            {"spec": {"engine": {"pipelineParallelSize": 1}, "resources": {"nodes": 1}}},
        )
        await wait_for(lambda: current(emulator, DEPLOYMENTS, ENGINE), what="a Deployment")
        await wait_for(lambda: current(emulator, LWS, GROUPS) is None, what="the LWS deleted")


async def test_a_canary_runs_as_a_second_leader_worker_set_and_is_promoted_by_group(
    emulator, api_client
):
    from .test_canary import FakeGateway

    install_lws(emulator)
    gateway = FakeGateway()
    document = manifest(EXAMPLE)
    document["spec"]["replicas"] = 4
    document["spec"]["rollout"] = {
        "strategy": "Canary",
        "steps": [{"weight": 10, "pauseSeconds": 0}, {"weight": 50, "pauseSeconds": 0}],
        "analysis": {"minRequests": 20},
    }
    canary = "llama-405b-canary-lws"

    def groups(name: str) -> int | None:
        lws = current(emulator, LWS, name)
        return None if lws is None else lws["spec"]["replicas"]

    async def ready(name: str) -> None:
        n = groups(name)
        status = {"replicas": n, "readyReplicas": n, "updatedReplicas": n}
        path = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets/{name}"
        await patch(api_client, f"{path}/status", {"status": status})

    def rollout() -> dict:
        return llmd_status(emulator).get("rollout") or {}

    async with running_operator(emulator, figures=gateway, rollout_seconds=0.1):
        await create(api_client, document)
        await wait_for(lambda: groups(GROUPS) == 4, what="the stable groups")
        await ready(GROUPS)
        await wait_for(lambda: rollout().get("phase") == "Stable", what="Stable")
        old = template_hash(current(emulator, LWS, GROUPS))
        source = "hf://meta-llama/Llama-3.1-405B-Instruct-v2"
        await patch(api_client, LLMD_PATH, {"spec": {"model": {"source": source}}})
        await wait_for(lambda: groups(canary) == 1, what="a canary group (10% of 4)")
        new = template_hash(current(emulator, LWS, canary))
        assert new != old and template_hash(current(emulator, LWS, GROUPS)) == old
        service = await wait_for(lambda: current(emulator, SERVICES, "llama-405b-engine-canary"))
        assert service["spec"]["selector"]["kubellm.io/role"] == "leader"
        await ready(canary)
        await wait_for(lambda: rollout().get("stepStartedAt"), what="step 1's window")
        gateway.serve(old, 270)
        gateway.serve(new, 30)
        await wait_for(lambda: groups(canary) == 2 and groups(GROUPS) == 2, what="50% by group")
        assert template_hash(current(emulator, LWS, GROUPS)) == old  # scaled, not rebuilt
        await ready(canary)
        await wait_for(lambda: rollout().get("step") == 2 and rollout().get("stepStartedAt"))
        gateway.serve(old, 100)
        gateway.serve(new, 100)
        await wait_for(lambda: template_hash(current(emulator, LWS, GROUPS)) == new,
                       what="the stable groups on the new revision")  # fmt: skip
        await ready(GROUPS)
        await wait_for(lambda: current(emulator, LWS, canary) is None, what="the canary gone")
        await wait_for(lambda: rollout().get("phase") == "Stable", what="Stable again")


def wide_moe() -> dict:
    """A DeepSeek-class MoE served wide on 2x8 GPUs: 16 data-parallel attention ranks (TP 1)
    with expert parallelism, each rank an endpoint of its own."""
    document = manifest(EXAMPLE)
    document["spec"]["engine"].update(
        {"tensorParallelSize": 1, "pipelineParallelSize": 1, "dataParallelSize": 16,
         "expertParallel": True}
    )  # fmt: skip
    return document


def endpoint_slice(service: dict, pods: dict[str, str]) -> dict:
    """What Kubernetes' EndpointSlice controller writes for `service` and its pods
    (name -> address): the Service's ports by name, its labels, one endpoint per pod."""
    return {
        "metadata": {"namespace": NS, "labels": service["metadata"]["labels"]},
        "ports": [{"name": p["name"], "port": p["port"]} for p in service["spec"]["ports"]],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": True}, "targetRef": {"name": pod}}
            for pod, ip in pods.items()
        ],
    }


async def test_data_parallel_ranks_are_endpoints_of_every_pod_and_one_replica_to_scale(
    emulator, api_client
):
    from kubellm.autoscaler import kube_backend
    from kubellm.autoscaler.observe import fold_ranks
    from kubellm.autoscaler.policy import ReplicaMetrics
    from kubellm.gateway.discovery import kubernetes as discovery

    install_lws(emulator)
    async with running_operator(emulator):
        await create(api_client, wide_moe())
        lws = await wait_for(lambda: current(emulator, LWS, GROUPS), what="the LeaderWorkerSet")
        service = await wait_for(lambda: current(emulator, SERVICES, ENGINE), what="the Service")
        await wait_for(lambda: llmd_status(emulator).get("selector"), what="status.selector")
        template = lws["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):  # every pod serves 8 ranks
            (container,) = template[role]["spec"]["containers"]
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports == {"http": 8000, **{f"http-dp{i}": 8000 + i for i in range(1, 8)}}
            assert container["readinessProbe"]["httpGet"]["port"] == "http"
        assert "kubellm.io/role" not in service["spec"]["selector"]  # leaders and workers
        assert "kubellm.io/role=leader" in llmd_status(emulator)["selector"]  # scale: groups
        assert [p["targetPort"] for p in service["spec"]["ports"]][1:] == [
            f"http-dp{i}" for i in range(1, 8)
        ]
        deployment = current(emulator, f"{api.GROUP}/{api.VERSION}/{api.PLURAL}", NAME)
    # the gateway: one endpoint per rank of the group's two pods
    pods = {f"{GROUPS}-0": "10.0.0.1", f"{GROUPS}-0-1": "10.0.0.2"}
    slice_ = endpoint_slice(service, pods)
    (target,) = discovery.build_targets(
        discovery.parse_deployments([deployment]), [slice_], {}
    ).values()
    assert len(target.endpoints) == 16
    assert {e.url for e in target.endpoints} == {
        f"http://{ip}:{8000 + i}" for ip in pods.values() for i in range(8)
    }
    # the autoscaler: the 16 ranks are one replica (the group), their load added up
    endpoints = kube_backend.slice_endpoints(slice_)
    assert {e.name for e in endpoints} == {f"{GROUPS}-0"}
    ranks = [ReplicaMetrics(e.name, True, waiting=1, running=2, kv_cache_usage=0.5)
             for e in endpoints]  # fmt: skip
    (replica,) = fold_ranks(ranks)
    assert (replica.waiting, replica.running, replica.kv_cache_usage) == (16, 32, 0.5)
