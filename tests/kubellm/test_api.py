"""LLMDeployment models: defaults a user expects and cross-field rules."""

from __future__ import annotations

import pytest

from kubellm import api, manifests


def _doc(**spec) -> dict:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "m"},
        "spec": {"model": {"source": "hf://org/model"}, **spec},
    }


def test_defaults() -> None:
    d = manifests.parse(_doc())
    assert d.spec.engine.prefix_caching is True
    assert d.spec.engine.chunked_prefill.enabled is True
    assert d.spec.engine.chunked_prefill.max_num_batched_tokens == 2048
    assert d.spec.autoscaling is None
    assert d.spec.routing.policy == "prefix-aware"
    assert d.spec.routing.load_bound == 1.25
    assert d.spec.replicas == 1
    assert d.spec.resources.gpu.resource_name == "nvidia.com/gpu"
    assert d.served_name == "m"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
        ({"engine": {"tensorParallelSize": 2}}, "spec.engine.tensorParallelSize"),
        ({"fallback": {"url": "https://x"}}, "spec.fallback.apiKeySecretRef"),
        ({"fallback": {"apiKeySecretRef": {"name": "s"}}}, "spec.fallback.url"),
        (
            {"fallback": {"url": "ftp://x", "apiKeySecretRef": {"name": "s"}}},
            "spec.fallback.url",
        ),
        ({"slo": {"itlSeconds": -1}}, "spec.slo.itlSeconds"),
        ({"slo": {"objective": 1}}, "spec.slo.objective"),
        ({"model": {"source": "gs://bucket/x"}}, "spec.model.source"),
        ({"routing": {"policy": "random"}}, "spec.routing.policy"),
        ({"replicas": -1}, "spec.replicas"),
    ],
)
def test_rules_reject_naming_the_field(spec: dict, field: str) -> None:
    with pytest.raises(manifests.ManifestError) as error:
        manifests.parse(_doc(**spec))
    assert field in str(error.value)


@pytest.mark.parametrize("scheme", ["hf://org/m", "pvc://claim/dir", "file:///m", "s3://b/k"])
def test_each_model_source_scheme_is_accepted(scheme: str) -> None:
    assert manifests.parse(_doc(model={"source": scheme})).spec.model.source == scheme


def test_tensor_parallel_within_gpu_count_is_accepted() -> None:
    d = manifests.parse(_doc(engine={"tensorParallelSize": 4}, resources={"gpu": {"count": 4}}))
    assert d.spec.engine.tensor_parallel_size == 4


def test_status_tolerates_unknown_fields() -> None:
    status = api.LLMDeploymentStatus.model_validate({"readyReplicas": 2, "futureField": 1})
    assert status.ready_replicas == 2


def test_bad_document_shape_is_reported() -> None:
    with pytest.raises(manifests.ManifestError, match="expected a mapping"):
        manifests.parse(["not", "a", "mapping"])  # type: ignore[arg-type]
