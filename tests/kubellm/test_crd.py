"""The generated CRD: no drift, structural, and it accepts and rejects what the models do."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kubellm import api, crd, manifests
from tests.fixtures import crd_validation

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / crd.CRD_FILENAME
VALID = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))


def _llmd_examples() -> list[Path]:
    return [p for p in VALID if yaml.safe_load(p.read_text()).get("kind") == api.KIND]


@pytest.fixture(scope="module")
def committed_crd() -> dict:
    return yaml.safe_load(COMMITTED.read_text())


def _expected_field(path: Path) -> str:
    match = re.search(r"^# field: (\S+)$", path.read_text(), re.MULTILINE)
    assert match, f"{path.name} must say which field it breaks (# field: ...)"
    return match.group(1)


def test_committed_crd_matches_the_models() -> None:
    assert COMMITTED.read_text() == crd.render(), "run `kubellm crds` and commit the result"


def test_crd_has_scale_and_status_subresources(committed_crd: dict) -> None:
    version = committed_crd["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert committed_crd["spec"]["names"]["shortNames"] == ["llmd"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Desired"] == ".spec.replicas"
    assert columns["Ready"] == ".status.readyReplicas"
    assert columns["KV-Cache"] == ".status.autoscaler.kvCacheUsage"


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural(committed_crd: dict) -> None:
    """Every node has a type; no refs, unions or 2020-12 keywords survive."""
    schema = crd_validation.schema_of(committed_crd)
    for path, node in _walk(schema):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        for keyword in ("$ref", "anyOf", "oneOf", "allOf", "const", "title"):
            assert keyword not in node, f"{path} uses {keyword}"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
        if "properties" in node:
            assert "additionalProperties" not in node, f"{path}: properties with additional"


def test_printer_column_paths_exist(committed_crd: dict) -> None:
    schema = crd_validation.schema_of(committed_crd)
    paths = {p for p, _ in _walk(schema)}
    for column in committed_crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        if column["jsonPath"].startswith(".metadata"):
            continue
        assert column["jsonPath"] in paths, column


@pytest.mark.parametrize("path", _llmd_examples(), ids=lambda p: p.name)
def test_examples_are_accepted_by_crd_and_models(committed_crd: dict, path: Path) -> None:
    document = yaml.safe_load(path.read_text())
    defaulted, errors = crd_validation.validate(committed_crd, document)
    assert errors == []
    model = manifests.parse(document)
    # The API server's defaults and the models' defaults agree.
    assert model.spec.model_dump(by_alias=True, exclude_none=True, mode="json") == defaulted["spec"]


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_are_rejected_naming_the_field(committed_crd: dict, path: Path) -> None:
    field = _expected_field(path)
    document = yaml.safe_load(path.read_text())
    _, errors = crd_validation.validate(committed_crd, document)
    assert errors, f"the CRD schema accepted {path.name}"
    assert any(field in e for e in errors), errors
    with pytest.raises(manifests.ManifestError) as rejected:
        manifests.parse(document)
    assert field in str(rejected.value)


def test_cel_rules_are_evaluated_not_just_declared(committed_crd: dict) -> None:
    """The same manifest flips from accepted to rejected on the one value a rule reads."""
    document = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "x"},
        "spec": {"model": {"source": "hf://a/b"}, "autoscaling": {"minReplicas": 2}},
    }
    assert crd_validation.validate(committed_crd, document)[1] == []
    document["spec"]["autoscaling"]["maxReplicas"] = 1
    errors = crd_validation.validate(committed_crd, document)[1]
    assert errors == [
        "spec.autoscaling.minReplicas: Invalid value: "
        "spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas"
    ]


def test_every_cel_rule_message_names_a_spec_field(committed_crd: dict) -> None:
    schema = crd_validation.schema_of(committed_crd)
    rules = [r for _, node in _walk(schema) for r in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 6
    for rule in rules:
        assert re.search(r"spec\.[a-zA-Z.]+", rule["message"]), rule


def _rule_names(node: dict) -> set[str]:
    """The field names the node's CEL rules read (every `.name` in their expressions)."""
    rules = node.get("x-kubernetes-validations", [])
    return {m for r in rules for m in re.findall(r"\.([A-Za-z_]\w*)", r["rule"])}


def _touched_strings(node: dict, names: set[str], path: str):
    """Strings under `node` that a rule reading `names` can reach (following only those
    names through objects and list items: conservative, a name read anywhere counts)."""
    if node.get("type") == "string":
        yield path, node
    for name, sub in node.get("properties", {}).items():
        if name in names:
            yield from _touched_strings(sub, names, f"{path}.{name}")
    if "items" in node:
        yield from _touched_strings(node["items"], names, f"{path}[]")


def unbounded(schema: dict) -> list[str]:
    """What a real API server would estimate at the request-size limit: a string a CEL rule
    reads or a pattern matches without maxLength (an enum is bounded by its values), a list
    without maxItems, a map without maxProperties. Each problem names its field."""
    problems = []
    for path, node in _walk(schema):
        if node.get("type") == "array" and "maxItems" not in node:
            problems.append(f"{path}: a list without maxItems")
        if isinstance(node.get("additionalProperties"), dict) and "maxProperties" not in node:
            problems.append(f"{path}: a map without maxProperties")
        if node.get("type") == "string" and "pattern" in node and "maxLength" not in node:
            problems.append(f"{path}: a string with a pattern and no maxLength")
        names = _rule_names(node)
        if path == "" and names:  # root rules: self is the object; follow spec and metadata
            names |= {"spec", "metadata"}
        for spath, sub in _touched_strings(node, names, path) if names else ():
            if "maxLength" not in sub and "enum" not in sub and spath.startswith(".spec"):
                problems.append(f"{spath}: a string a CEL rule reads, without maxLength")
    return sorted(set(problems))


def test_every_string_rules_read_and_every_list_and_map_are_bounded(committed_crd: dict) -> None:
    """An API server refuses a CRD whose rules' estimated cost is over its budget, and
    estimates an unbounded string or list at the request's size limit (3 MiB)."""
    assert unbounded(crd_validation.schema_of(committed_crd)) == []


def test_the_bound_walk_finds_an_unbounded_field() -> None:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "x-kubernetes-validations": [{"rule": "self.url.startsWith('http')"}],
                "properties": {
                    "url": {"type": "string"},
                    "args": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "name": {"type": "string", "pattern": "^a$"},
                },
            }
        },
    }
    assert unbounded(schema) == [
        ".spec.labels: a map without maxProperties",
        ".spec.name: a string with a pattern and no maxLength",
        ".spec.url: a string a CEL rule reads, without maxLength",
    ]


def test_every_field_the_autoscaler_persists_survives_the_schema(committed_crd) -> None:
    """The apiserver prunes status fields its structural schema lacks: what the policy
    keeps between periods (status.autoscaler) must be declared, or a restart forgets it
    (overflowSince was written and never declared)."""
    from kubellm.autoscaler.policy import PolicyState

    version = committed_crd["spec"]["versions"][0]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    declared = set(status["properties"]["autoscaler"]["properties"])
    missing = set(PolicyState(overflow_since=1.0, peak_rate=1.0).to_status()) - declared
    assert not missing, f"status.autoscaler lacks {sorted(missing)}"
