"""Least-privilege RBAC: every API request a component makes is granted, nothing more.

Two lists meet here:

- the requests each component makes, recorded by its emulator tests in
  `<component>/rbac-requests.yaml` (operator, gateway, autoscaler). Format: RBAC rules,
  `rules: [{apiGroups: [...], resources: [...], verbs: [...]}]` ("" is the core group,
  "llmdeployments/status" a subresource); a plain list of `{apiGroup, resource, verbs}` is read
  too. `CONTRACT` below, from the component contract, is the base of the ceiling.
- `CEILING`: what the chart may grant each component at most, with every option switched on.
  Widening it is a reviewed change to this file.

The chart's grants must cover the first and stay inside the second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import ROOT, component, objects, of_kind, render_values

Grant = tuple[str, str, str]  # (apiGroup, resource, verb)
# Children are server-side applied: a PATCH creates them, so no create or update verb.
APPLY = ("get", "list", "watch", "patch", "delete")


def _grants(*entries: tuple[str, str, tuple[str, ...]]) -> set[Grant]:
    return {(group, resource, verb) for group, resource, verbs in entries for verb in verbs}


# What each component needs, from the component contract (DESIGN.md, the issues).
CONTRACT: dict[str, set[Grant]] = {
    "operator": _grants(
        ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch")),
        ("kubellm.io", "llmdeployments", ("get", "list", "watch", "patch")),
        ("kubellm.io", "llmdeployments/status", ("patch",)),
        ("apps", "deployments", APPLY),
        ("", "services", APPLY),
        ("", "configmaps", APPLY),
        ("policy", "poddisruptionbudgets", APPLY),
        ("leaderworkerset.x-k8s.io", "leaderworkersets", APPLY),  # replicas spanning pods
        ("monitoring.coreos.com", "podmonitors", ("get", "patch", "delete")),
        ("inference.networking.k8s.io", "inferencepools", ("get", "patch", "delete")),
        ("gateway.networking.k8s.io", "httproutes", ("get", "patch", "delete")),
        # Each pool's own endpoint picker: its account and Role; the EndpointSlice reads are
        # what that Role grants (no one may grant what it does not hold).
        ("", "serviceaccounts", ("get", "patch", "delete")),
        ("rbac.authorization.k8s.io", "roles", ("get", "patch", "delete")),
        ("rbac.authorization.k8s.io", "rolebindings", ("get", "patch", "delete")),
        ("discovery.k8s.io", "endpointslices", ("list", "watch")),
        ("", "pods", ("list",)),
        ("", "secrets", ("get",)),
        ("", "events", ("create",)),
    ),
    "gateway": _grants(
        ("kubellm.io", "llmdeployments", ("get", "list", "watch")),
        ("discovery.k8s.io", "endpointslices", ("list", "watch")),
        ("", "secrets", ("get",)),
    ),
    "autoscaler": _grants(
        # patch: spec.prefill.replicas (the prefill role's; the kind's one scale
        # subresource is the decode role's spec.replicas)
        ("kubellm.io", "llmdeployments", ("get", "list", "watch", "patch")),
        ("kubellm.io", "llmdeployments/scale", ("get", "patch", "update")),
        ("kubellm.io", "llmdeployments/status", ("patch",)),
        ("discovery.k8s.io", "endpointslices", ("list", "watch")),
        ("", "events", ("create",)),
    ),
}

# The most the chart may grant, all options on. Beyond the contract: kopf's peering objects
# (several operator replicas) and Events in the new API group for the autoscaler.
CEILING: dict[str, set[Grant]] = {
    "operator": CONTRACT["operator"]
    | _grants(
        ("kopf.dev", "clusterkopfpeerings", ("get", "list", "watch", "patch")),
        ("", "namespaces", ("list", "watch")),
    ),
    "gateway": set(CONTRACT["gateway"]),
    "autoscaler": CONTRACT["autoscaler"] | _grants(("events.k8s.io", "events", ("create",))),
}

# Grants that exist only when a value switches them on: recorded requests for these are checked
# against a render with the switch on.
OPTIONAL: dict[tuple[str, str], dict[str, Any]] = {
    ("kopf.dev", "clusterkopfpeerings"): {"operator": {"peering": "kubellm"}},
    ("", "namespaces"): {"operator": {"namespaces": ["team-*"]}},
}


def recorded_requests(name: str) -> set[Grant]:
    """The requests the component's emulator tests recorded."""
    return parse_requests(ROOT / name / "rbac-requests.yaml")


def parse_requests(path: Path) -> set[Grant]:
    """Read `rules: [{apiGroups, resources, verbs}]` or `[{apiGroup, resource, verbs}]`."""
    doc = yaml.safe_load(path.read_text()) or []
    entries = doc["rules"] if isinstance(doc, dict) and "rules" in doc else doc
    assert isinstance(entries, list), f"{path}: expected `rules:` or a list of requests"
    out = set()
    for i, entry in enumerate(entries):
        if "apiGroups" in entry or "resources" in entry:
            keys, groups = ("apiGroups", "resources", "verbs"), entry.get("apiGroups")
            resources = entry.get("resources")
        else:
            keys = ("apiGroup", "resource", "verbs")
            groups, resources = [entry.get("apiGroup")], [entry.get("resource")]
        missing = [k for k in keys if k not in entry]
        assert not missing, f"{path}[{i}]: missing {missing}"
        out |= {(g, r, v) for g in groups for r in resources for v in entry["verbs"]}
    return out


def granted(objs: list[dict[str, Any]], name: str) -> set[Grant]:
    """Everything the component's ServiceAccount is granted by the rendered roles and bindings."""
    (deployment,) = [d for d in of_kind(objs, "Deployment") if component(d) == name]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    namespace = deployment["metadata"]["namespace"]
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objs
             if o["kind"] in ("ClusterRole", "Role")}  # fmt: skip
    out: set[Grant] = set()
    for binding in of_kind(objs, "ClusterRoleBinding") + of_kind(objs, "RoleBinding"):
        subjects = binding.get("subjects", [])
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == account and s["namespace"] == namespace
            for s in subjects
        ):
            continue
        ref = binding["roleRef"]
        role_ns = None if ref["kind"] == "ClusterRole" else binding["metadata"]["namespace"]
        role = roles[(ref["kind"], role_ns, ref["name"])]
        for rule in role["rules"]:
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert "*" not in (group, resource, verb), f"wildcard in {rule}"
                        out.add((group, resource, verb))
    return out


def _fmt(grants: set[Grant]) -> str:
    return "\n".join(f"  {g or 'core'}/{r}: {v}" for g, r, v in sorted(grants))


@pytest.mark.parametrize("name", ["operator", "gateway", "autoscaler"])
def test_every_request_is_granted(name: str) -> None:
    requests = recorded_requests(name)
    default = granted(objects("default"), name)
    missing = set()
    for grant in requests - default:
        switch = OPTIONAL.get(grant[:2])
        if switch is None or grant not in granted(render_values(switch), name):
            missing.add(grant)
    assert not missing, f"{name} makes requests the chart does not grant:\n{_fmt(missing)}"


@pytest.mark.parametrize("value_set", ["default", "full-values"])
@pytest.mark.parametrize("name", ["operator", "gateway", "autoscaler"])
def test_nothing_beyond_the_ceiling_is_granted(name: str, value_set: str) -> None:
    extra = granted(objects(value_set), name) - CEILING[name]
    assert not extra, f"the chart grants {name} more than the stated list:\n{_fmt(extra)}"


@pytest.mark.parametrize("name", ["operator", "gateway", "autoscaler"])
def test_recorded_requests_stay_inside_the_ceiling(name: str) -> None:
    extra = recorded_requests(name) - CEILING[name]
    assert not extra, (
        f"{name} records requests beyond the stated list; widen CEILING in this file "
        f"(a reviewed change) and the chart's role:\n{_fmt(extra)}"
    )


@pytest.mark.parametrize("name", ["operator", "gateway", "autoscaler"])
def test_a_recording_component_is_granted_exactly_its_requests(name: str) -> None:
    """Each component records its requests; the default install grants exactly those."""
    path = ROOT / name / "rbac-requests.yaml"
    assert path.exists(), f"{path.relative_to(ROOT)}: the component's emulator tests record it"
    extra = granted(objects("default"), name) - parse_requests(path)
    assert not extra, f"{name} is granted requests it never makes:\n{_fmt(extra)}"


def test_scoped_secret_reads_are_granted_only_in_listed_namespaces() -> None:
    objs = objects("full-values")
    bindings = [b for b in of_kind(objs, "RoleBinding") if component(b) == "gateway"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert ("", "secrets", "get") in granted(objs, "gateway")
    cluster_role = next(r for r in of_kind(objs, "ClusterRole") if component(r) == "gateway")
    assert all("secrets" not in rule["resources"] for rule in cluster_role["rules"])


def test_a_component_gets_only_its_own_roles() -> None:
    objs = objects("default")
    for name in ("gateway", "autoscaler"):
        assert ("apps", "deployments", "create") not in granted(objs, name)
    assert ("kubellm.io", "llmdeployments/scale", "patch") not in granted(objs, "operator")
    assert ("kubellm.io", "llmdeployments/scale", "patch") not in granted(objs, "gateway")


def test_parse_requests_names_a_malformed_entry(tmp_path: Path) -> None:
    path = tmp_path / "rbac-requests.yaml"
    path.write_text("- apiGroup: ''\n  resource: pods\n")
    with pytest.raises(AssertionError, match=r"\[0\]: missing \['verbs'\]"):
        parse_requests(path)
    path.write_text("rules:\n- apiGroups: ['', apps]\n  resources: [pods]\n  verbs: [list]\n")
    assert parse_requests(path) == {("", "pods", "list"), ("apps", "pods", "list")}
