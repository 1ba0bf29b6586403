"""Table tests of status: observations -> conditions with reasons a person can act on."""

from __future__ import annotations

import pytest
from kubellm.operator import status
from kubellm.operator.status import Problem

NOW = "2026-01-01T00:00:00Z"


def deployment(replicas=2, ready=2, updated=2, generation=1, observed=1, conditions=()):
    return {
        "metadata": {"generation": generation},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "observedGeneration": observed,
            "conditions": list(conditions),
        },
    }


def by_type(conds):
    return {c["type"]: (c["status"], c["reason"]) for c in conds}


@pytest.mark.parametrize(
    ("desired", "dep", "problems", "expected"),
    [
        (
            2,
            deployment(),
            [],
            {
                "Ready": ("True", "AllReplicasReady"),
                "Progressing": ("False", "RolloutComplete"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            2,
            None,
            [],
            {
                "Ready": ("False", "NoDeployment"),
                "Progressing": ("True", "Creating"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            3,
            deployment(replicas=2, ready=2, updated=2),
            [],
            {
                "Ready": ("False", "ReplicasNotReady"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            2,
            deployment(generation=2, observed=1),
            [],
            {
                "Ready": ("True", "AllReplicasReady"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            1,
            deployment(replicas=2, ready=2, updated=2),
            [],
            {
                "Ready": ("True", "AllReplicasReady"),
                "Progressing": ("True", "ScalingDown"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            2,
            deployment(ready=1),
            [Problem("InsufficientGPUs", "no GPUs")],
            {
                "Ready": ("False", "InsufficientGPUs"),
                "Progressing": ("True", "WaitingForReplicas"),
                "Degraded": ("True", "InsufficientGPUs"),
            },
        ),
        (
            0,
            deployment(replicas=0, ready=0, updated=0),
            [],
            {
                "Ready": ("False", "ScaledToZero"),
                "Progressing": ("False", "RolloutComplete"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            2,
            deployment(
                ready=0,
                conditions=[
                    {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
                ],
            ),
            [],
            {
                "Ready": ("False", "ProgressDeadlineExceeded"),
                "Progressing": ("False", "ProgressDeadlineExceeded"),
                "Degraded": ("True", "ProgressDeadlineExceeded"),
            },
        ),
    ],
)
def test_conditions(desired, dep, problems, expected):
    conds = status.conditions(
        desired_replicas=desired, deployment=dep, problems=problems, generation=4
    )
    assert by_type(conds) == expected
    assert all(c["observedGeneration"] == 4 for c in conds)


def pod(conditions=(), containers=()):
    return {
        "metadata": {"name": "p-1"},
        "status": {"conditions": list(conditions), "containerStatuses": list(containers)},
    }


@pytest.mark.parametrize(
    ("p", "reason", "hint"),
    [
        (
            pod(
                conditions=[
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                    }
                ]
            ),
            "InsufficientGPUs",
            "spec.resources.gpu.count",
        ),
        (
            pod(
                conditions=[
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes match node selector",
                    }
                ]
            ),
            "Unschedulable",
            "spec.scheduling",
        ),
        (
            pod(
                containers=[
                    {
                        "image": "bad:1",
                        "state": {
                            "waiting": {"reason": "ImagePullBackOff", "message": "not found"}
                        },
                    }
                ]
            ),
            "ImagePullFailed",
            "spec.engine.image",
        ),
        (
            pod(
                containers=[
                    {
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {
                            "terminated": {
                                "exitCode": 2,
                                "message": "usage: ...\nerror: unrecognized arguments: --bogus",
                            }
                        },
                    }
                ]
            ),
            "InvalidEngineArguments",
            "unrecognized arguments: --bogus",
        ),
        (
            pod(
                containers=[
                    {
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"exitCode": 137}},
                    }
                ]
            ),
            "CrashLoopBackOff",
            "kubectl logs p-1 --previous",
        ),
    ],
)
def test_pod_problems(p, reason, hint):
    (problem,) = status.pod_problems([p], "nvidia.com/gpu")
    assert problem.reason == reason
    assert hint in problem.message


def test_healthy_pods_have_no_problems():
    healthy = pod(
        conditions=[{"type": "PodScheduled", "status": "True"}],
        containers=[{"state": {"running": {}}}],
    )
    assert status.pod_problems([healthy], "nvidia.com/gpu") == []


def test_transition_time_is_kept_while_the_status_holds():
    old = [{"type": "Ready", "status": "True", "reason": "A", "lastTransitionTime": "then"}]
    same = status.merge_conditions([{"type": "Ready", "status": "True", "reason": "B"}], old, NOW)
    flipped = status.merge_conditions(
        [{"type": "Ready", "status": "False", "reason": "C"}], old, NOW
    )
    assert same[0]["lastTransitionTime"] == "then"
    assert flipped[0]["lastTransitionTime"] == NOW


def _desired(old_status, dep=None):
    return status.desired_status(
        generation=3,
        desired_replicas=2,
        selector="a=b",
        deployment=dep or deployment(),
        problems=[],
        capacity={"kvBytesPerToken": 1},
        old_status=old_status,
        now=NOW,
    )


def test_status_patch_is_none_when_nothing_changed_and_never_names_the_autoscaler():
    """Nor status.adapters, which the autoscaler writes too."""
    first = _desired({})
    assert "autoscaler" not in first and "adapters" not in first
    adapters = [{"name": "sql", "loadedReplicas": 1, "activeReplicas": 0, "replicas": 2}]
    written = {**first, "autoscaler": {"desiredReplicas": 5}, "adapters": adapters}
    assert status.status_patch(_desired(written), written) is None
    patch = status.status_patch(_desired(written, deployment(ready=1)), written)
    assert set(patch) == {"readyReplicas", "conditions"}


def test_events_fire_on_transitions_only():
    healthy = status.conditions(
        desired_replicas=1, deployment=deployment(1, 1, 1), problems=[], generation=1
    )
    broken = status.conditions(
        desired_replicas=1,
        deployment=deployment(1, 0, 1),
        problems=[Problem("ImagePullFailed", "x")],
        generation=1,
    )
    assert status.transitions(healthy, healthy) == []
    assert ("Warning", "ImagePullFailed", "x") in status.transitions(healthy, broken)
    back = status.transitions(broken, healthy)
    assert ("Normal", "Recovered", "no problems found") in back
    assert any(e[1] == "Ready" for e in back)
