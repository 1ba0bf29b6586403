"""Canary rollouts against the API emulator, with kopf running the real operator.

The test plays the Deployment controller (it marks Deployments rolled out) and the
gateway (a figures source whose per-revision counters it sets), and waits on the
operator's answer with a deadline: the canary Deployment appears beside an untouched
stable one, steps advance on passing figures, a failing step rolls back, abort and
promote by annotation, status, conditions and Events at each step, and no writes in a
steady state."""

from __future__ import annotations

import copy
from typing import Any

from kubellm.operator import rollout_cli
from kubellm.operator.rollout import Counters

from kubellm import api

from .conftest import create, patch, running_operator, wait_for, writes_since
from .test_operator import LLMD, condition, current, event_reasons, llmd_status, spec_hash

NS = "llm"
NAME = "m"
STABLE = "m-engine"
CANARY = "m-engine-canary"
DEPLOYMENTS = "apps/v1/deployments"
CONFIGMAPS = "v1/configmaps"
SERVICES = "v1/services"
PATH = f"/apis/{api.API_VERSION}/namespaces/{NS}/{api.PLURAL}/{NAME}"

MANIFEST: dict[str, Any] = {
    "apiVersion": api.API_VERSION,
    "kind": api.KIND,
    "metadata": {"name": NAME, "namespace": NS, "uid": "uid-c", "generation": 1},
    "spec": {
        "model": {"source": "hf://org/model"},
        "resources": {"gpu": {"count": 0}},
        "replicas": 4,
        "slo": {"ttftSeconds": 1, "itlSeconds": 0.1, "objective": 0.99},
        "rollout": {
            "strategy": "Canary",
            "steps": [{"weight": 10, "pauseSeconds": 0}, {"weight": 50, "pauseSeconds": 0}],
            "analysis": {"minRequests": 20},
        },
    },
}


from tests.fixtures.canary import c  # noqa: E402


class FakeGateway:
    """The gateway's cumulative per-revision counters, as the test sets them."""

    def __init__(self) -> None:
        self.counters: dict[str, Counters] = {}

    async def __call__(self, namespace: str, name: str, model: str) -> dict[str, Counters]:
        return dict(self.counters)

    def serve(self, revision: str, requests: int, ttft: float = 0.2, errors: int = 0) -> None:
        """`requests` more answers from `revision` with mean TTFT `ttft`."""
        before = self.counters.get(revision, Counters())
        self.counters[revision] = before.plus(c(requests=requests, errors=errors, ttft=ttft))


def rollout_status(emulator) -> dict[str, Any]:
    return llmd_status(emulator, NAME, NS).get("rollout") or {}


async def rolled_out(api_client, emulator, name: str) -> None:
    """What the Deployment controller does once all of a Deployment's pods are ready."""
    deployment = current(emulator, DEPLOYMENTS, name, NS)
    replicas = deployment["spec"]["replicas"]
    await patch(
        api_client,
        f"/apis/apps/v1/namespaces/{NS}/deployments/{name}/status",
        {"status": {"observedGeneration": deployment["metadata"].get("generation", 1),
                    "replicas": replicas, "readyReplicas": replicas,
                    "updatedReplicas": replicas, "availableReplicas": replicas}},
    )  # fmt: skip


def replicas(emulator, name: str) -> int | None:
    deployment = current(emulator, DEPLOYMENTS, name, NS)
    return None if deployment is None else deployment["spec"]["replicas"]


async def start_canary(api_client, emulator) -> tuple[str, str, dict[str, Any]]:
    """Create the deployment, roll its stable revision out, change the model: the canary
    revision starts. Returns (stable revision, canary revision, stable ConfigMap)."""
    await create(api_client, copy.deepcopy(MANIFEST))
    await wait_for(lambda: current(emulator, DEPLOYMENTS, STABLE, NS), what="stable Deployment")
    await rolled_out(api_client, emulator, STABLE)
    await wait_for(lambda: rollout_status(emulator).get("phase") == "Stable", what="Stable")
    stable = current(emulator, DEPLOYMENTS, STABLE, NS)
    old = spec_hash(stable)
    old_configmap = copy.deepcopy(current(emulator, CONFIGMAPS, "m-engine-spec", NS))
    await patch(api_client, PATH, {"spec": {"model": {"source": "hf://org/model-v2"}}})
    canary = await wait_for(lambda: current(emulator, DEPLOYMENTS, CANARY, NS), what="canary")
    return old, spec_hash(canary), old_configmap


async def open_window(api_client, emulator, step: int) -> None:
    await wait_for(lambda: rollout_status(emulator).get("step") == step, what=f"step {step}")
    await rolled_out(api_client, emulator, CANARY)
    await wait_for(lambda: rollout_status(emulator).get("stepStartedAt"), what="window open")


async def test_a_good_revision_advances_through_its_steps_and_is_promoted(emulator, api_client):
    gateway = FakeGateway()
    async with running_operator(emulator, figures=gateway, rollout_seconds=0.1):
        old, new, old_configmap = await start_canary(api_client, emulator)
        assert new != old
        # The stable revision is untouched: same template, same engine spec, its replicas.
        stable = current(emulator, DEPLOYMENTS, STABLE, NS)
        assert spec_hash(stable) == old and stable["spec"]["replicas"] == 4
        configmap = current(emulator, CONFIGMAPS, "m-engine-spec", NS)
        assert configmap["data"] == old_configmap["data"]
        assert (
            "model-v2"
            in current(emulator, CONFIGMAPS, "m-engine-spec-canary", NS)["data"][
                "llmdeployment.json"
            ]
        )
        service = await wait_for(lambda: current(emulator, SERVICES, CANARY, NS), what="Service")
        assert service["metadata"]["labels"]["kubellm.io/revision"] == new
        assert replicas(emulator, CANARY) == 1  # ceil(4 x 10%)
        status = await wait_for(lambda: (s := rollout_status(emulator)).get("canaryRevision") and s)
        assert (status["phase"], status["step"], status["canaryWeight"]) == ("Progressing", 1, 10)
        assert (status["stableRevision"], status["revision"]) == (old, new)
        await wait_for(lambda: condition(emulator, "Progressing", NAME, NS)
                       == ("True", "CanaryProgressing"))  # fmt: skip
        assert condition(emulator, "RolledBack", NAME, NS) == ("False", "NotRolledBack")
        await wait_for(lambda: "CanaryStarted" in event_reasons(emulator), what="an Event")

        gateway.serve(old, 300)
        await open_window(api_client, emulator, 1)
        assert rollout_status(emulator)["baseline"][old]["requests"] == 300
        # the scale subresource counts both revisions' pods (its selector matches both)
        await wait_for(lambda: llmd_status(emulator, NAME, NS).get("readyReplicas") == 5)
        gateway.serve(old, 270)
        gateway.serve(new, 30)
        # step 2: 50%, the stable Deployment scaled (not rebuilt) to its share
        await wait_for(lambda: replicas(emulator, CANARY) == 2, what="canary at 50%")
        await wait_for(lambda: replicas(emulator, STABLE) == 2, what="stable at 50%")
        assert spec_hash(current(emulator, DEPLOYMENTS, STABLE, NS)) == old
        await wait_for(lambda: rollout_status(emulator)["canaryWeight"] == 50, what="weight 50")
        assert rollout_status(emulator)["verdict"]["result"] == "Pass"
        await open_window(api_client, emulator, 2)
        gateway.serve(old, 100)
        gateway.serve(new, 100)
        # promotion: the stable Deployment takes the new revision, then the canary goes
        await wait_for(lambda: spec_hash(current(emulator, DEPLOYMENTS, STABLE, NS)) == new,
                       what="stable rebuilt at the new revision")  # fmt: skip
        await wait_for(lambda: rollout_status(emulator)["phase"] == "Promoting")
        await wait_for(
            lambda: condition(emulator, "Progressing", NAME, NS) == ("True", "Promoting")
        )
        assert replicas(emulator, STABLE) == 4 and replicas(emulator, CANARY) == 2
        await rolled_out(api_client, emulator, STABLE)
        await wait_for(lambda: current(emulator, DEPLOYMENTS, CANARY, NS) is None, what="gone")
        await wait_for(lambda: current(emulator, CONFIGMAPS, "m-engine-spec-canary", NS) is None)
        await wait_for(lambda: current(emulator, SERVICES, CANARY, NS) is None)
        final = await wait_for(lambda: (s := rollout_status(emulator))["phase"] == "Stable" and s)
        assert final == {"revision": new, "stableRevision": new, "phase": "Stable",
                         "canaryWeight": 0}  # fmt: skip
        for reason in ("CanaryStarted", "CanaryStep", "Promoting", "Promoted"):
            await wait_for(lambda r=reason: r in event_reasons(emulator), what=f"{reason} Event")


async def test_a_failed_analysis_scales_the_canary_to_zero_and_restores_stable(
    emulator, api_client
):
    gateway = FakeGateway()
    async with running_operator(emulator, figures=gateway, rollout_seconds=0.1, resync_seconds=0.2):
        old, new, _ = await start_canary(api_client, emulator)
        gateway.serve(old, 300)
        await open_window(api_client, emulator, 1)
        gateway.serve(old, 270, ttft=0.2)
        gateway.serve(new, 30, ttft=0.6)  # 3x slower
        await wait_for(lambda: replicas(emulator, CANARY) == 0, what="canary at zero")
        assert replicas(emulator, STABLE) == 4
        assert spec_hash(current(emulator, DEPLOYMENTS, STABLE, NS)) == old
        status = await wait_for(
            lambda: (s := rollout_status(emulator))["phase"] == "RolledBack" and s
        )
        assert (status["phase"], status["canaryWeight"]) == ("RolledBack", 0)
        assert status["verdict"]["result"] == "Fail"
        assert status["verdict"]["canary"]["ttftSeconds"] == 0.6
        await wait_for(lambda: condition(emulator, "RolledBack", NAME, NS)
                       == ("True", "CanaryTTFTRegression"))  # fmt: skip
        cond = next(c for c in llmd_status(emulator, NAME, NS)["conditions"]
                    if c["type"] == "RolledBack")  # fmt: skip
        assert "maxTTFTRatio" in cond["message"]
        await wait_for(lambda: "RolledBack" in event_reasons(emulator), what="a Warning")
        # Rolled back is a steady state: resync passes write nothing.
        mark = len(list(emulator))
        reads = f"GET {PATH}"
        await wait_for(
            lambda: (
                [f"{r.method.value} {r.url.path}" for r in list(emulator)[mark:]].count(reads) >= 3
            ),
            what="three resync passes",
        )
        assert [w for w in writes_since(emulator, mark) if "/events" not in w] == []


async def test_abort_then_promote_by_annotation(emulator, api_client):
    gateway = FakeGateway()
    async with running_operator(emulator, figures=gateway, rollout_seconds=0.1):
        _, new, _ = await start_canary(api_client, emulator)
        await open_window(api_client, emulator, 1)
        annotation = "kubellm.io/rollout-action"
        # `kubellm rollout abort m -n llm` (its requests, through the test's client)
        code, said = await rollout_cli.act(api_client, NS, NAME, "abort")
        assert code == 0 and "abort" in said
        await wait_for(lambda: rollout_status(emulator).get("phase") == "RolledBack")
        await wait_for(lambda: replicas(emulator, CANARY) == 0)
        await wait_for(lambda: condition(emulator, "RolledBack", NAME, NS) == ("True", "Aborted"))
        code, said = await rollout_cli.act(api_client, NS, NAME, "status")
        assert code == 0 and "RolledBack" in said and "Aborted" in said
        assert (await rollout_cli.act(api_client, NS, "nope", "abort"))[0] == 1
        await wait_for(lambda: annotation not in current(emulator, LLMD, NAME, NS)["metadata"].get(
            "annotations", {}), what="the annotation removed")  # fmt: skip
        await patch(api_client, PATH, {"metadata": {"annotations": {annotation: "promote"}}})
        await wait_for(lambda: spec_hash(current(emulator, DEPLOYMENTS, STABLE, NS)) == new)
        await wait_for(lambda: rollout_status(emulator)["phase"] == "Promoting")
        await wait_for(lambda: condition(emulator, "RolledBack", NAME, NS)[0] == "False")


async def test_scaling_and_routing_edits_start_no_revision(emulator, api_client):
    async with running_operator(emulator, rollout_seconds=0.1):
        await create(api_client, copy.deepcopy(MANIFEST))
        await wait_for(lambda: current(emulator, DEPLOYMENTS, STABLE, NS))
        await rolled_out(api_client, emulator, STABLE)
        await wait_for(lambda: rollout_status(emulator).get("phase") == "Stable")
        await patch(api_client, PATH, {"spec": {"replicas": 6, "routing": {"loadBound": 2}}})
        await wait_for(lambda: replicas(emulator, STABLE) == 6)
        assert current(emulator, DEPLOYMENTS, CANARY, NS) is None
        assert rollout_status(emulator)["phase"] == "Stable"
