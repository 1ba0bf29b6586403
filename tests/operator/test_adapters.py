"""Adapters in the operator: the ConfigMap carries them, the pod template hash does not.

An adapter added to or removed from spec.adapters is loaded or unloaded on running
replicas at runtime (by the gateway, docs/architecture.md), so the engine Deployment's
pod template must not change: no GPU pod restarts.
"""

from __future__ import annotations

from typing import Any

import kmock
import pytest
from kubellm.operator import builders

from kubellm import api, manifests

from .conftest import ROOT, create, manifest, patch, running_operator, wait_for

LORA_EXAMPLE = ROOT / "examples" / "lora-adapters.yaml"
NS = "default"
NAME = "llama-teams"
ENGINE = f"{NAME}-engine"
LLMD_PATH = f"/apis/{api.API_VERSION}/namespaces/{NS}/{api.PLURAL}/{NAME}"


def _llmd(adapters: list[dict[str, str]], engine: dict[str, Any] | None = None):
    return manifests.parse(
        {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "metadata": {"name": "llama"},
            "spec": {
                "model": {"source": "hf://org/llama"},
                "adapters": adapters,
                "engine": engine or {},
                "resources": {"gpu": {"count": 1}},
            },
        }
    )


def _template_hash(llmd: api.LLMDeployment) -> str:
    deployment = builders.engine_deployment(llmd)
    return deployment["spec"]["template"]["metadata"]["annotations"][builders.SPEC_HASH_ANNOTATION]


A = {"name": "a", "source": "hf://org/a"}
B = {"name": "b", "source": "pvc://adapters/b"}


def test_adding_or_removing_adapters_keeps_the_pod_template_hash() -> None:
    one, two = _llmd([A]), _llmd([A, B])
    assert _template_hash(one) == _template_hash(two)
    assert '"name": "b"' in builders.spec_configmap(two)["data"]["llmdeployment.json"]
    assert '"name": "b"' not in builders.spec_configmap(one)["data"]["llmdeployment.json"]


def test_turning_lora_on_or_changing_its_slots_rolls_the_pods() -> None:
    """vLLM enables LoRA only at start: the first adapter (or maxLoras) is a restart."""
    none, one = _llmd([]), _llmd([A])
    assert _template_hash(none) != _template_hash(one)
    assert _template_hash(one) != _template_hash(_llmd([A], {"maxLoras": 8}))
    # with maxLoras set, even the first adapter restarts nothing
    assert _template_hash(_llmd([], {"maxLoras": 2})) == _template_hash(_llmd([A], {"maxLoras": 2}))


def current(emulator, resource: str, name: str) -> dict[str, Any] | None:
    key = (kmock.resource(resource), NS, name)
    if key not in emulator.objects or emulator.objects[key].deleted:
        return None
    return emulator.objects[key].raw


async def test_a_spec_edit_adding_an_adapter_updates_the_configmap_not_the_pods(
    emulator, api_client
) -> None:
    async with running_operator(emulator):
        await create(api_client, manifest(LORA_EXAMPLE))
        before = await wait_for(lambda: current(emulator, "apps/v1/deployments", ENGINE))
        old_hash = before["spec"]["template"]["metadata"]["annotations"]["kubellm.io/spec-hash"]
        adapters = manifest(LORA_EXAMPLE)["spec"]["adapters"]
        adapters.append({"name": "new-team", "source": "hf://acme/new-team-lora"})
        await patch(api_client, LLMD_PATH, {"spec": {"adapters": adapters}})
        configmap = await wait_for(
            lambda: (
                (c := current(emulator, "v1/configmaps", f"{NAME}-engine-spec"))
                and "new-team" in c["data"]["llmdeployment.json"]
                and c
            ),
            what="the ConfigMap with the new adapter",
        )
        assert "acme/new-team-lora" in configmap["data"]["llmdeployment.json"]
        after = current(emulator, "apps/v1/deployments", ENGINE)
        assert after["spec"]["template"]["metadata"]["annotations"]["kubellm.io/spec-hash"] == (
            old_hash
        )


@pytest.mark.parametrize(
    ("model", "source", "words"),
    [
        ("pvc://models/llama", "pvc://other/a", "another claim than the model's"),
        ("hf://org/llama", "pvc://models/a", "another claim than the model's"),
        ("hf://org/llama", "s3://bucket/a", "s3:// sources are not supported"),
        ("hf://org/llama", "hf://org/a@v2", "repository id only"),
    ],
)
def test_adapters_a_pod_could_not_load_are_refused_naming_the_adapter(
    model: str, source: str, words: str
) -> None:
    llmd = _llmd([{"name": "sql", "source": source}])
    llmd.spec.model.source = model
    with pytest.raises(builders.SpecError, match=words) as refused:
        builders.build(llmd)
    assert refused.value.reason == "UnsupportedAdapterSource"
    assert "spec.adapters sql" in str(refused.value)


def test_adapters_on_the_models_claim_hf_or_file_pass() -> None:
    adapters = [
        {"name": "a", "source": "pvc://models/adapters/a"},
        {"name": "b", "source": "hf://org/b"},
        {"name": "c", "source": "file:///x/c"},
    ]
    llmd = _llmd(adapters)
    llmd.spec.model.source = "pvc://models/llama"
    assert builders.build(llmd)[1]["kind"] == "Deployment"
