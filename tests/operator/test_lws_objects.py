"""The objects of a replica that spans pods: `kubellm render` of the 405B example yields a
LeaderWorkerSet valid against the upstream LeaderWorkerSet v1 CRD (tests/fixtures/lws), with
pod templates valid against Kubernetes' own schema and the restricted pod security profile."""

from __future__ import annotations

import copy
from argparse import ArgumentParser
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubellm.operator import builders, render

from kubellm import manifests
from tests.fixtures import crd_validation

from .conftest import ROOT
from .test_builders import KUBERNETES_VERSIONS

EXAMPLE = ROOT / "examples" / "llama-3.1-405b-multinode.yaml"
LWS_CRD = yaml.safe_load(
    (Path(__file__).resolve().parents[1] / "fixtures" / "lws"
     / "leaderworkerset.x-k8s.io_leaderworkersets.yaml").read_text()
)  # fmt: skip


def rendered(capsys) -> list[dict]:
    parser = ArgumentParser()
    render.configure(parser)
    assert render.run(parser.parse_args(["-f", str(EXAMPLE)])) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


def as_pod(template: dict) -> dict:
    metadata = {**template["metadata"], "name": "p"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


def templates(lws: dict) -> dict[str, dict]:
    group = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": group["leaderTemplate"], "worker": group["workerTemplate"]}


def test_render_of_the_405b_example_is_a_leader_worker_set_valid_upstream(capsys) -> None:
    documents = rendered(capsys)
    assert [d["kind"] for d in documents] == [
        "ConfigMap", "LeaderWorkerSet", "Service", "PodDisruptionBudget",
    ]  # fmt: skip
    (lws,) = [d for d in documents if d["kind"] == "LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    _, errors = crd_validation.validate(LWS_CRD, lws, version="v1")
    assert errors == []
    for document in documents:
        if document["kind"] == "LeaderWorkerSet":
            for template in templates(document).values():
                for version in KUBERNETES_VERSIONS:
                    kubernetes_validate.validate(as_pod(template), version, strict=True)
        else:
            for version in KUBERNETES_VERSIONS:
                kubernetes_validate.validate(document, version, strict=True)


def test_the_upstream_schema_check_bites() -> None:
    lws = builders.engine_workload(next(manifests.load(EXAMPLE)))
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnWhim"
    assert crd_validation.validate(LWS_CRD, bad, version="v1")[1]
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["groupSize"] = 2
    assert crd_validation.validate(LWS_CRD, bad, version="v1")[1]
    pod = as_pod(templates(lws)["worker"])
    pod["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("role", ["leader", "worker"])
def test_both_roles_meet_the_restricted_pod_security_profile(role: str) -> None:
    pod = templates(builders.engine_workload(next(manifests.load(EXAMPLE))))[role]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    ctx = container["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False


def test_the_leader_serves_and_the_workers_only_join() -> None:
    llmd = next(manifests.load(EXAMPLE))
    lws = builders.engine_workload(llmd)
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == llmd.spec.resources.nodes == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # the leader waits for its workers
    leader, worker = (c["spec"]["containers"][0] for c in templates(lws).values())
    assert leader["ports"][0]["name"] == "http" and "readinessProbe" in leader
    assert "ports" not in worker and "readinessProbe" not in worker
    assert leader["command"] == worker["command"]  # the launcher reads its rank from LWS
    for c in (leader, worker):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"  # GPUs of one pod
    roles = {r: t["metadata"]["labels"]["kubellm.io/role"] for r, t in templates(lws).items()}
    assert roles == {"leader": "leader", "worker": "worker"}
    service = builders.engine_service(llmd)
    assert service["spec"]["selector"]["kubellm.io/role"] == "leader"
    assert (
        "kubellm.io/role" not in builders.disruption_budget(llmd)["spec"]["selector"]["matchLabels"]
    )  # a worker's eviction takes its group down: counted too
    assert lws["metadata"]["name"] != service["metadata"]["name"]  # LWS's own headless Service


def test_one_node_replicas_stay_a_deployment() -> None:
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["resources"]["nodes"] = 1
    document["spec"]["engine"]["pipelineParallelSize"] = 1
    kinds = [o["kind"] for o in builders.build(manifests.parse(document))]
    assert "Deployment" in kinds and "LeaderWorkerSet" not in kinds


def test_without_the_crd_the_spec_is_refused_naming_the_field() -> None:
    llmd = next(manifests.load(EXAMPLE))
    with pytest.raises(builders.SpecError) as error:
        builders.build(llmd, builders.Options(leader_worker_set=False))
    assert error.value.reason == "LeaderWorkerSetMissing"
    assert "spec.resources.nodes" in str(error.value)
