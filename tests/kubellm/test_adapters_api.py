"""spec.adapters and the engine's LoRA limits: the CEL rules, through the models and the CRD."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kubellm import api, crd, manifests
from tests.fixtures import crd_validation

COMMITTED = Path(__file__).resolve().parents[2] / "crds" / crd.CRD_FILENAME


@pytest.fixture(scope="module")
def committed_crd() -> dict:
    return yaml.safe_load(COMMITTED.read_text())


def _doc(adapters: list[dict[str, Any]], served: str | None = None, name: str = "base") -> dict:
    model: dict[str, Any] = {"source": "hf://org/base"}
    if served is not None:
        model["servedName"] = served
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": name},
        "spec": {"model": model, "adapters": adapters},
    }


A = {"name": "a", "source": "pvc://adapters/a"}
B = {"name": "b", "source": "hf://org/b-lora"}

# (case, adapters, servedName, metadata.name, the field the refusal names or None)
CASES = [
    ("none", [], None, "base", None),
    ("two distinct", [A, B], None, "base", None),
    ("duplicate names", [A, {**B, "name": "a"}], None, "base", "spec.adapters"),
    ("three with one duplicate", [A, B, {**B, "source": "file:///x"}], None, "base",
     "spec.adapters"),
    ("named like metadata.name (servedName unset)", [{**A, "name": "base"}], None, "base",
     "spec.adapters"),
    ("named like servedName", [{**A, "name": "llama"}], "llama", "base", "spec.adapters"),
    ("named like metadata.name, servedName set elsewhere", [{**A, "name": "base"}], "llama",
     "base", None),
    ("source without a scheme", [{**A, "source": "/data/a"}], None, "base", "spec.adapters[0]"),
    ("unknown scheme", [{**A, "source": "ftp://x/a"}], None, "base", "spec.adapters[0]"),
    ("name with a space", [{**A, "name": "a b"}], None, "base", "spec.adapters[0].name"),
    ("empty name", [{**A, "name": ""}], None, "base", "spec.adapters[0].name"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("adapters", "served", "name", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_adapter_rules_agree_in_models_and_crd(
    committed_crd: dict, adapters: list, served: str | None, name: str, field: str | None
) -> None:
    document = _doc(adapters, served, name)
    _, errors = crd_validation.validate(committed_crd, document)
    if field is None:
        assert errors == []
        assert [a.name for a in manifests.parse(document).spec.adapters] == [
            a["name"] for a in adapters
        ]
        return
    assert errors and any(e.startswith(field) for e in errors), errors
    with pytest.raises(manifests.ManifestError) as refused:
        manifests.parse(document)
    assert field.split("[")[0] in str(refused.value)


@pytest.mark.parametrize(
    ("engine", "field"),
    [
        ({"maxLoras": 2, "maxLoraRank": 64}, None),
        ({"maxLoras": 0}, "spec.engine.maxLoras"),
        ({"maxLoras": 257}, "spec.engine.maxLoras"),
        ({"maxLoraRank": 24}, "spec.engine.maxLoraRank"),
        ({"maxLoraRank": 512}, None),
    ],
)
def test_engine_lora_limits(committed_crd: dict, engine: dict, field: str | None) -> None:
    document = _doc([A])
    document["spec"]["engine"] = engine
    _, errors = crd_validation.validate(committed_crd, document)
    if field is None:
        assert errors == []
        manifests.parse(document)
        return
    assert any(e.startswith(field) for e in errors), errors
    with pytest.raises(manifests.ManifestError, match=field.rsplit(".", 1)[-1]):
        manifests.parse(document)


def test_too_many_adapters_are_refused(committed_crd: dict) -> None:
    adapters = [{"name": f"a{i}", "source": f"pvc://adapters/a{i}"} for i in range(65)]
    _, errors = crd_validation.validate(committed_crd, _doc(adapters))
    assert any(e.startswith("spec.adapters") for e in errors), errors
    with pytest.raises(manifests.ManifestError, match=r"spec\.adapters"):
        manifests.parse(_doc(adapters))


def test_status_adapters_shape() -> None:
    status = api.LLMDeploymentStatus.model_validate(
        {"adapters": [{"name": "a", "loadedReplicas": 1, "replicas": 3}]}
    )
    assert status.adapters == [api.AdapterStatus(name="a", loaded_replicas=1, replicas=3)]
