"""Prefill/decode disaggregation (spec.prefill) in the operator: a Deployment, Service and PDB
per role, labelled by role; the pool selects both; a canary revision runs both roles; removing
spec.prefill removes the prefill role's objects; an unchanged pair costs no writes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubellm.operator import builders

from kubellm import api, contracts, manifests

from .conftest import ROOT, create, manifest, patch, running_operator, wait_for, writes_over_resyncs
from .test_operator import current, handled_by_kopf, llmd_status

EXAMPLE = ROOT / "examples" / "llama-3.1-8b-prefill-decode.yaml"
NS = "llm"
NAME = "llama-8b-pd"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
PDBS = "policy/v1/poddisruptionbudgets"
ROLE = contracts.ROLE_LABEL
LLMD_PATH = f"/apis/{api.API_VERSION}/namespaces/{NS}/{api.PLURAL}/{NAME}"


def document(**prefill: Any) -> dict[str, Any]:
    doc = manifest(EXAMPLE)
    doc["metadata"]["namespace"] = NS
    doc["spec"]["routing"] = {"inferencePool": {}}
    doc["spec"]["prefill"].update(prefill)
    return doc


def objects(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    llmd = manifests.parse(doc)
    built = builders.build(llmd, builders.Options(inference_pool=True))
    return {(o["kind"], o["metadata"]["name"]): o for o in built}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_each_role_has_its_deployment_service_and_pdb_labelled_by_role() -> None:
    built = objects(document())
    prefill = built[("Deployment", "llama-8b-pd-prefill")]
    decode = built[("Deployment", "llama-8b-pd-engine")]
    p_pod = prefill["spec"]["template"]["metadata"]["labels"]
    d_pod = decode["spec"]["template"]["metadata"]["labels"]
    assert (p_pod[ROLE], d_pod[ROLE]) == ("prefill", "decode")
    assert prefill["metadata"]["labels"][ROLE] == "prefill"
    assert decode["metadata"]["labels"][ROLE] == "decode"
    # Both Deployments carry the revision: a request's legs can be kept on one revision.
    rev = contracts.REVISION_LABEL
    assert prefill["metadata"]["labels"][rev] == decode["metadata"]["labels"][rev]
    # The decode Deployment keeps its immutable selector; the prefill one never takes its pods.
    assert decode["spec"]["selector"]["matchLabels"] == builders.selector_labels(
        manifests.parse(document())
    )
    assert not selects(prefill["spec"]["selector"]["matchLabels"], d_pod)
    # Each role's Service and PDB select that role's pods only; EndpointSlices copy the label.
    for kind, field in (("Service", ("spec", "selector")),
                        ("PodDisruptionBudget", ("spec", "selector", "matchLabels"))):  # fmt: skip
        for name, own, other in (("llama-8b-pd-prefill", p_pod, d_pod),
                                 ("llama-8b-pd-engine", d_pod, p_pod)):  # fmt: skip
            obj = built[(kind, name)]
            selector = obj[field[0]][field[1]] if len(field) == 2 else obj["spec"]["selector"][
                "matchLabels"]  # fmt: skip
            assert selects(selector, own) and not selects(selector, other), (kind, name)
            assert obj["metadata"]["labels"][ROLE] == own[ROLE]
    # The InferencePool selects both roles' pods.
    pool = built[("InferencePool", "llama-8b-pd-engine")]["spec"]["selector"]["matchLabels"]
    assert selects(pool, p_pod) and selects(pool, d_pod)


def test_each_role_runs_the_launcher_for_its_role_with_its_resources() -> None:
    doc = document(replicas=3, resources={"gpu": {"count": 2}, "memory": "64Gi"})
    built = objects(doc)
    prefill = built[("Deployment", "llama-8b-pd-prefill")]["spec"]
    decode = built[("Deployment", "llama-8b-pd-engine")]["spec"]
    (p_container,) = prefill["template"]["spec"]["containers"]
    (d_container,) = decode["template"]["spec"]["containers"]
    assert p_container["command"][-2:] == ["--role", "prefill"]
    assert d_container["command"][-2:] == ["--role", "decode"]
    assert p_container["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "2"}
    assert d_container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert (prefill["replicas"], decode["replicas"]) == (3, 2)


def test_without_prefill_nothing_is_labelled_by_role_and_no_prefill_objects() -> None:
    doc = document()
    del doc["spec"]["prefill"]
    built = objects(doc)
    assert not [k for k in built if "prefill" in k[1]]
    for obj in built.values():
        assert ROLE not in obj["metadata"].get("labels", {}), obj["metadata"]["name"]
    (container,) = built[("Deployment", "llama-8b-pd-engine")]["spec"]["template"]["spec"][
        "containers"
    ]
    assert "--role" not in container["command"]


def test_prefill_has_no_replicas_while_decode_has_none() -> None:
    doc = document(replicas=2)
    doc["spec"]["replicas"] = 0
    assert objects(doc)[("Deployment", "llama-8b-pd-prefill")]["spec"]["replicas"] == 0
    doc["spec"]["replicas"] = 1
    assert objects(doc)[("Deployment", "llama-8b-pd-prefill")]["spec"]["replicas"] == 2


def test_the_revision_follows_the_connector_not_the_prefill_replicas() -> None:
    base = manifests.parse(document())
    scaled = manifests.parse(document(replicas=4, autoscaling={"maxReplicas": 9}))
    other = manifests.parse(document(kvConnector={"type": "LMCache"}))
    assert contracts.revision(base) == contracts.revision(scaled)
    assert contracts.revision(base) != contracts.revision(other)


def test_kv_transfer_config_in_extra_args_is_refused_with_the_field() -> None:
    doc = document()
    doc["spec"]["engine"]["extraArgs"] = ["--kv-transfer-config={}"]
    with pytest.raises(builders.SpecError, match=r"spec\.prefill\.kvConnector"):
        objects(doc)


def test_a_canary_revision_runs_both_roles_labelled_with_its_revision() -> None:
    llmd = manifests.parse(document())
    built = builders.build_canary(llmd, 1, prefill_replicas_canary=1)
    canary = {(o["kind"], o["metadata"]["name"]): o for o in built}
    rev = contracts.revision(llmd)
    service = canary[("Service", "llama-8b-pd-prefill-canary")]
    assert service["metadata"]["labels"][contracts.REVISION_LABEL] == rev
    assert service["metadata"]["labels"][ROLE] == "prefill"
    deployment = canary[("Deployment", "llama-8b-pd-prefill-canary")]
    pod = deployment["spec"]["template"]["metadata"]["labels"]
    assert (pod[contracts.REVISION_LABEL], pod[contracts.TRACK_LABEL], pod[ROLE]) == (
        rev, contracts.CANARY_TRACK, "prefill")  # fmt: skip
    stable_prefill = objects(document())[("Deployment", "llama-8b-pd-prefill")]
    assert not selects(deployment["spec"]["selector"]["matchLabels"],
                       stable_prefill["spec"]["template"]["metadata"]["labels"])  # fmt: skip
    decode_service = canary[("Service", "llama-8b-pd-engine-canary")]
    assert decode_service["spec"]["selector"][ROLE] == "decode"


# --------------------------------------------------------------------------- the real operator


async def test_prefill_role_is_created_left_alone_and_removed(emulator, api_client) -> None:
    doc = document()
    del doc["spec"]["routing"]
    async with running_operator(emulator, resync_seconds=0.2):
        await create(api_client, copy.deepcopy(doc))
        for resource in (DEPLOYMENTS, SERVICES, PDBS):
            await wait_for(lambda r=resource: current(emulator, r, "llama-8b-pd-prefill", NS),
                           timeout=60, what=f"{resource} of the prefill role")  # fmt: skip
        await wait_for(lambda: llmd_status(emulator, NAME, NS)["prefill"] == {
            "replicas": 1, "readyReplicas": 0}, timeout=60, what="status.prefill")  # fmt: skip
        # A ready prefill replica shows in status; then a steady state writes nothing.
        await patch(
            api_client,
            f"/apis/apps/v1/namespaces/{NS}/deployments/llama-8b-pd-prefill/status",
            {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}},
        )
        await wait_for(lambda: llmd_status(emulator, NAME, NS)["prefill"]["readyReplicas"] == 1,
                       timeout=60, what="the ready prefill replica")  # fmt: skip
        await wait_for(lambda: handled_by_kopf(emulator, NAME, NS), timeout=60, what="kopf")
        assert [
            w for w in await writes_over_resyncs(emulator, LLMD_PATH) if "/events" not in w
        ] == []
        # Removing spec.prefill deletes the prefill role's objects and its status.
        await patch(api_client, LLMD_PATH, {"spec": {"prefill": None}})
        for resource in (DEPLOYMENTS, SERVICES, PDBS):
            await wait_for(lambda r=resource: current(emulator, r, "llama-8b-pd-prefill", NS)
                           is None, timeout=60, what=f"{resource} removed")  # fmt: skip
        await wait_for(lambda: "prefill" not in llmd_status(emulator, NAME, NS), timeout=60,
                       what="status.prefill removed")  # fmt: skip

        # The decode engines roll to an aggregated engine (no connector role): a new revision.
        # (The API server's apply drops the role label the operator no longer sets; the
        # emulator merges, so the label is not checked here: test_without_prefill_... does.)
        def aggregated() -> bool:
            engine = current(emulator, DEPLOYMENTS, "llama-8b-pd-engine", NS)
            (container,) = engine["spec"]["template"]["spec"]["containers"]
            return "--role" not in container["command"]

        await wait_for(aggregated, timeout=60, what="the decode role rolled to aggregated")


async def test_a_canary_revision_runs_both_roles_beside_the_stable_ones(emulator, api_client):
    from .test_canary import MANIFEST, PATH, STABLE, FakeGateway, rolled_out, rollout_status

    manifest_ = copy.deepcopy(MANIFEST)
    manifest_["spec"]["prefill"] = {"replicas": 2}
    ns, prefill, canary = "llm", "m-prefill", "m-prefill-canary"
    async with running_operator(emulator, figures=FakeGateway(), rollout_seconds=0.1):
        await create(api_client, manifest_)
        await wait_for(lambda: current(emulator, DEPLOYMENTS, prefill, ns), timeout=60)
        await rolled_out(api_client, emulator, STABLE)
        await rolled_out(api_client, emulator, prefill)
        await wait_for(lambda: rollout_status(emulator).get("phase") == "Stable", timeout=60)
        old = current(emulator, DEPLOYMENTS, prefill, ns)["metadata"]["labels"][
            contracts.REVISION_LABEL
        ]
        await patch(api_client, PATH, {"spec": {"model": {"source": "hf://org/model-v2"}}})
        deployment = await wait_for(lambda: current(emulator, DEPLOYMENTS, canary, ns),
                                    timeout=60, what="the prefill canary")  # fmt: skip
        new = deployment["metadata"]["labels"][contracts.REVISION_LABEL]
        assert new != old
        assert deployment["spec"]["replicas"] == 1  # ceil(2 x 10%)
        assert deployment["spec"]["template"]["metadata"]["labels"][ROLE] == "prefill"
        service = await wait_for(lambda: current(emulator, SERVICES, canary, ns), timeout=60)
        assert service["metadata"]["labels"][contracts.REVISION_LABEL] == new
        # The stable prefill role keeps its revision; its replicas follow the split (2 x 90%).
        stable = current(emulator, DEPLOYMENTS, prefill, ns)
        assert stable["metadata"]["labels"][contracts.REVISION_LABEL] == old
        assert stable["spec"]["replicas"] == 2
        # Aborting scales both roles' canaries to zero (as decode's), the stable ones stay.
        await patch(api_client, PATH, {"metadata": {"annotations": {
            contracts.ROLLOUT_ACTION_ANNOTATION: "abort"}}})  # fmt: skip
        await wait_for(lambda: current(emulator, DEPLOYMENTS, canary, ns)["spec"]["replicas"] == 0,
                       timeout=60, what="the prefill canary at zero")  # fmt: skip
        assert current(emulator, DEPLOYMENTS, prefill, ns)["spec"]["replicas"] == 2
