"""Table tests of planning: desired vs observed -> create, update, delete, leave alone."""

from __future__ import annotations

import copy

import pytest
from kubellm.operator.plan import Ref, contains, plan, quantity

UID = "owner-uid"


def obj(kind="Service", name="m-engine", owner=UID, **spec):
    meta = {"name": name, "namespace": "ns", "labels": {"a": "b"}}
    if owner:
        meta["ownerReferences"] = [{"uid": owner, "controller": True, "name": "m"}]
    return {"apiVersion": "v1", "kind": kind, "metadata": meta, "spec": spec}


def live(desired, **extra):
    """What the API server returns: our fields plus its own."""
    out = copy.deepcopy(desired)
    out["metadata"].update(uid="x", resourceVersion="7", managedFields=[{}])
    out["spec"].update(extra)
    out["status"] = {"loadBalancer": {}}
    return out


def ref(o):
    return Ref.of(o)


def test_missing_child_is_created():
    want = obj(ports=[{"name": "http", "port": 80}])
    result = plan([want], {ref(want): None}, UID)
    assert [(a.verb, a.ref) for a in result.actions] == [("create", ref(want))]
    assert result.actions[0].body == want


def test_unchanged_child_is_left_alone_despite_server_defaults():
    want = obj(ports=[{"name": "http", "port": 80}])
    have = live(want, clusterIP="10.0.0.1", sessionAffinity="None")
    have["spec"]["ports"][0]["protocol"] = "TCP"  # defaulted inside a named list item
    result = plan([want], {ref(want): have}, UID)
    assert result.actions == [] and result.unchanged == [ref(want)]


@pytest.mark.parametrize(
    "edit",
    [
        lambda o: o["spec"]["ports"][0].update(port=81),
        lambda o: o["spec"]["ports"].clear(),
        lambda o: o["metadata"]["labels"].pop("a"),
        lambda o: o["spec"].update(args=["x", "z"]),
        lambda o: o["spec"]["args"].append("extra"),
    ],
)
def test_drifted_child_is_updated(edit):
    want = obj(ports=[{"name": "http", "port": 80}], args=["x", "y"])
    have = live(want)
    edit(have)
    result = plan([want], {ref(want): have}, UID)
    assert [(a.verb, a.ref) for a in result.actions] == [("update", ref(want))]


def test_child_no_longer_wanted_is_deleted_only_when_owned():
    pdb = obj(kind="PodDisruptionBudget")
    foreign = obj(kind="PodMonitor", owner="someone-else")
    result = plan([], {ref(pdb): live(pdb), ref(foreign): live(foreign)}, UID)
    assert [(a.verb, a.ref) for a in result.actions] == [("delete", ref(pdb))]


def test_object_owned_by_someone_else_is_a_conflict_not_a_write():
    want = obj()
    have = live(obj(owner="other"))
    result = plan([want], {ref(want): have}, UID)
    assert result.actions == [] and result.conflicts == [ref(want)]


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", 1), ("500m", 0.5), ("1Gi", 2**30), ("64Gi", 64 * 2**30), ("1.5k", 1500), ("1e3", 1000)],
)
def test_quantities(text, value):
    assert quantity(text) == value


@pytest.mark.parametrize(
    ("want", "have", "same"),
    [
        ({"cpu": "1000m"}, {"cpu": "1"}, True),  # the API server canonicalises quantities
        ({"memory": "1Gi"}, {"memory": "1024Mi"}, True),
        ({"memory": "1Gi"}, {"memory": "1G"}, False),
        ({"replicas": 1}, {"replicas": "1"}, False),
        ({"flag": True}, {"flag": 1}, False),
        ({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}, True),
        ({"a": [1, 2]}, {"a": [2, 1]}, False),
        ({"a": [{"name": "x", "v": 1}]}, {"a": [{"name": "y"}, {"name": "x", "v": 1}]}, True),
        ({"a": None}, {}, False),
    ],
)
def test_contains(want, have, same):
    assert contains(want, have) is same
