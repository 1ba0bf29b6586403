"""Pure status: what the operator observed -> `LLMDeployment.status` and its conditions.

Conditions answer three questions a person asks, each with a reason they can act on:
- Ready: can the deployment serve with every replica it asked for?
- Progressing: is a rollout or a scale change under way?
- Degraded: is something wrong that will not fix itself (no GPUs, bad image,
  crash loop, bad engine arguments, missing fallback Secret, unrealisable spec)?

`status.autoscaler` and `status.adapters` belong to the autoscaler: they are never
produced here, and the patch the operator writes never names them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Exit status of argparse (and so of the engine launcher) on bad command-line arguments.
USAGE_EXIT_CODE = 2
IMAGE_PULL_REASONS = frozenset(
    {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"}
)


@dataclass(frozen=True)
class Problem:
    """Something wrong, as a condition reason and a sentence saying what to do."""

    reason: str
    message: str


# --------------------------------------------------------------------------- pods


def _gpu_shortage(message: str, gpu_resource: str) -> bool:
    return f"Insufficient {gpu_resource}" in message


def pod_problems(pods: Sequence[Mapping[str, Any]], gpu_resource: str) -> list[Problem]:
    """Problems visible on engine pods: scheduling, image pulls, crash loops."""
    found: dict[str, Problem] = {}
    for pod in pods:
        name = pod.get("metadata", {}).get("name", "?")
        status = pod.get("status") or {}
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                message = cond.get("message") or ""
                if _gpu_shortage(message, gpu_resource):
                    found.setdefault(
                        "InsufficientGPUs",
                        Problem(
                            "InsufficientGPUs",
                            f"pod {name} cannot be scheduled: no node has a free {gpu_resource} "
                            f"({message}); add GPU nodes, free GPUs or lower "
                            "spec.resources.gpu.count",
                        ),
                    )
                elif cond.get("reason") == "Unschedulable":
                    found.setdefault(
                        "Unschedulable",
                        Problem(
                            "Unschedulable",
                            f"pod {name} cannot be scheduled: {message}; check "
                            "spec.scheduling and spec.resources",
                        ),
                    )
        for container in status.get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in IMAGE_PULL_REASONS:
                found.setdefault(
                    "ImagePullFailed",
                    Problem(
                        "ImagePullFailed",
                        f"pod {name} cannot pull image {container.get('image', '')!r} "
                        f"({reason}: {waiting.get('message', '')}); check spec.engine.image "
                        "and the registry credentials",
                    ),
                )
            elif reason == "CrashLoopBackOff":
                last = (container.get("lastState") or {}).get("terminated") or {}
                detail = (last.get("message") or "").strip().splitlines()
                tail = f": {detail[-1]}" if detail else ""
                if last.get("exitCode") == USAGE_EXIT_CODE:
                    found.setdefault(
                        "InvalidEngineArguments",
                        Problem(
                            "InvalidEngineArguments",
                            f"the engine in pod {name} rejected its arguments{tail}; "
                            "check spec.engine (extraArgs in particular)",
                        ),
                    )
                else:
                    found.setdefault(
                        "CrashLoopBackOff",
                        Problem(
                            "CrashLoopBackOff",
                            f"the engine in pod {name} keeps exiting (exit code "
                            f"{last.get('exitCode', '?')}){tail}; see `kubectl logs {name} "
                            "--previous`",
                        ),
                    )
    return list(found.values())


# --------------------------------------------------------------------------- conditions


def _condition(
    kind: str, ok: bool, reason: str, message: str, generation: int | None
) -> dict[str, Any]:
    cond: dict[str, Any] = {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _deployment_condition(deployment: Mapping[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in (deployment or {}).get("status", {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return {}


def generation_observed(workload: Mapping[str, Any] | None) -> bool:
    """Whether the workload's controller has seen its latest spec. A Deployment says so in
    status.observedGeneration; LeaderWorkerSet v1 has no such field, so its status (groups
    ready and updated) is taken as current."""
    if workload is None:
        return False
    observed = (workload.get("status") or {}).get("observedGeneration")
    if observed is None and workload.get("kind") == "LeaderWorkerSet":
        return True
    return int(observed or 0) >= int((workload.get("metadata") or {}).get("generation", 0))


def conditions(
    *,
    desired_replicas: int,
    deployment: Mapping[str, Any] | None,
    problems: Sequence[Problem],
    generation: int | None,
) -> list[dict[str, Any]]:
    """Ready, Progressing and Degraded (without transition times; see `merge_conditions`)."""
    dstatus = (deployment or {}).get("status") or {}
    ready = int(dstatus.get("readyReplicas") or 0)
    updated = int(dstatus.get("updatedReplicas") or 0)
    total = int(dstatus.get("replicas") or 0)
    rolled = generation_observed(deployment)
    deadline = _deployment_condition(deployment, "Progressing").get("reason") == (
        "ProgressDeadlineExceeded"
    )
    all_problems = list(problems)
    if deadline:
        all_problems.append(
            Problem(
                "ProgressDeadlineExceeded",
                "the engine rollout made no progress within its deadline; see the engine "
                "pods' events",
            )
        )
    first = all_problems[0] if all_problems else None

    # Ready
    if deployment is None:
        is_ready, reason, message = (
            False,
            "NoDeployment",
            "the engine Deployment does not exist yet",
        )
    elif desired_replicas == 0:
        is_ready, reason, message = (
            False,
            "ScaledToZero",
            "spec.replicas is 0: no engine runs; the gateway sends requests to the fallback",
        )
    elif ready >= desired_replicas:
        is_ready, reason, message = True, "AllReplicasReady", f"{ready}/{desired_replicas} ready"
    else:
        is_ready = False
        reason = first.reason if first else "ReplicasNotReady"
        message = f"{ready}/{desired_replicas} replicas ready" + (
            f": {first.message}" if first else ""
        )
    out = [_condition("Ready", is_ready, reason, message, generation)]

    # Progressing
    if deployment is None:
        prog = (True, "Creating", "creating the engine Deployment")
    elif deadline:
        prog = (False, "ProgressDeadlineExceeded", all_problems[-1].message)
    elif not rolled or updated < desired_replicas or total > desired_replicas:
        if total > desired_replicas and updated >= desired_replicas:
            prog = (True, "ScalingDown", f"{total} replicas, going to {desired_replicas}")
        else:
            prog = (
                True,
                "RollingOut",
                f"{updated}/{desired_replicas} replicas on the current spec",
            )
    elif ready < desired_replicas:
        prog = (True, "WaitingForReplicas", f"{ready}/{desired_replicas} replicas ready")
    else:
        prog = (False, "RolloutComplete", f"{desired_replicas} replicas on the current spec")
    out.append(_condition("Progressing", *prog, generation))

    # Degraded
    if all_problems:
        message = "; ".join(p.message for p in all_problems)
        out.append(_condition("Degraded", True, all_problems[0].reason, message, generation))
    else:
        out.append(_condition("Degraded", False, "AsExpected", "no problems found", generation))
    return out


def inference_pool_condition(
    wanted: bool,
    installed: bool,
    route_wanted: bool,
    route_installed: bool,
    pool: Mapping[str, Any] | None,
    generation: int | None,
) -> dict[str, Any] | None:
    """The `InferencePool` condition: whether the Gateways took the pool, from the parent
    conditions (Accepted, ResolvedRefs) their controllers write on it; None when the spec
    asks for no pool. A missing CRD is said here, not as Degraded: the engines serve."""
    if not wanted:
        return None
    if not installed:
        return _condition(
            "InferencePool", False, "InferenceExtensionNotInstalled",
            "spec.routing.inferencePool is set, but the Gateway API Inference Extension's "
            "CRDs (inferencepools.inference.networking.k8s.io/v1) are not installed: no "
            "InferencePool was created; install them or remove the field",
            generation,
        )  # fmt: skip
    if route_wanted and not route_installed:
        return _condition(
            "InferencePool", False, "GatewayAPINotInstalled",
            "spec.routing.inferencePool.parentRefs is set, but Gateway API's HTTPRoute CRD "
            "(httproutes.gateway.networking.k8s.io/v1) is not installed: no HTTPRoute was "
            "created",
            generation,
        )  # fmt: skip
    parents = ((pool or {}).get("status") or {}).get("parents") or []
    problems: list[str] = []
    accepted: list[str] = []
    for parent in parents:
        ref = parent.get("parentRef") or {}
        who = f"{ref.get('kind', 'Gateway')} {ref.get('namespace') or ''}/{ref.get('name', '?')}"
        for cond in parent.get("conditions") or []:
            if cond.get("type") not in ("Accepted", "ResolvedRefs"):
                continue
            if cond.get("status") == "False":
                problems.append(
                    f"{who}: {cond['type']}=False ({cond.get('reason', '')}: "
                    f"{cond.get('message', '')})"
                )
            elif cond.get("type") == "Accepted" and cond.get("status") == "True":
                accepted.append(who)
    if problems:
        return _condition("InferencePool", False, "NotAccepted", "; ".join(problems), generation)
    if accepted:
        message = "accepted by " + ", ".join(accepted)
        return _condition("InferencePool", True, "Accepted", message, generation)
    cond = _condition(
        "InferencePool", False, "WaitingForGateway",
        "no Gateway has accepted the InferencePool yet: reference it from an HTTPRoute "
        "(spec.routing.inferencePool.parentRefs creates one) on a Gateway whose "
        "implementation supports the Inference Extension",
        generation,
    )  # fmt: skip
    cond["status"] = "Unknown"
    return cond


def merge_conditions(
    new: Sequence[Mapping[str, Any]], old: Sequence[Mapping[str, Any]], now: str
) -> list[dict[str, Any]]:
    """Keep lastTransitionTime of conditions whose status did not change; stamp the rest."""
    previous = {c.get("type"): c for c in old}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"]
        stamp = before.get("lastTransitionTime") if same and before else None
        merged.append({**cond, "lastTransitionTime": stamp or now})
    return merged


def rollout_conditions(
    phase: str | None,
    message: str,
    rolled_back: tuple[str, str] | None,
    canary_strategy: bool,
    generation: int | None,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The canary rollout's conditions: a Progressing that replaces the Deployment's while a
    canary runs or is being promoted (else None), and RolledBack (with the Canary strategy,
    or while a rolled-back canary is kept), True with the reason the analysis or a person
    gave."""
    progressing = None
    if phase == "Progressing":
        progressing = _condition("Progressing", True, "CanaryProgressing", message, generation)
    elif phase == "Promoting":
        progressing = _condition("Progressing", True, "Promoting", message, generation)
    extra = []
    if rolled_back is not None:
        extra.append(_condition("RolledBack", True, rolled_back[0], rolled_back[1], generation))
    elif canary_strategy:
        extra.append(
            _condition("RolledBack", False, "NotRolledBack", "no canary rolled back", generation)
        )
    return progressing, extra


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch that turns `old` into `new` (keys gone from `new` become null)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out = {k: merge_patch(old.get(k), v) for k, v in new.items() if old.get(k) != v}
        out.update({k: None for k in old if k not in new})
        return out
    return new


def desired_status(
    *,
    generation: int | None,
    desired_replicas: int,
    selector: str,
    deployment: Mapping[str, Any] | None,
    problems: Sequence[Problem],
    capacity: Mapping[str, Any] | None,
    old_status: Mapping[str, Any] | None,
    now: str,
    extra_conditions: Sequence[Mapping[str, Any]] = (),
    rollout: Mapping[str, Any] | None = None,
    progressing: Mapping[str, Any] | None = None,
    canary: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every status field the operator owns (never `autoscaler` or `adapters`). `extra_conditions`
    (e.g. `InferencePool`, `RolledBack`) follow Ready, Progressing and Degraded; `progressing`
    replaces the Deployment's Progressing (a canary rollout's); `rollout` is status.rollout;
    `canary` (the canary revision's Deployment, while one runs) adds its pods to the counts
    the scale subresource reports (the selector matches both revisions' pods)."""
    old_status = old_status or {}
    dstatus = (deployment or {}).get("status") or {}
    cstatus = (canary or {}).get("status") or {}
    conds = conditions(
        desired_replicas=desired_replicas,
        deployment=deployment,
        problems=problems,
        generation=generation,
    )
    if progressing is not None:
        conds = [dict(progressing) if c["type"] == "Progressing" else c for c in conds]
    conds += [dict(c) for c in extra_conditions]
    out = {
        "observedGeneration": generation,
        "replicas": int(dstatus.get("replicas") or 0) + int(cstatus.get("replicas") or 0),
        "readyReplicas": int(dstatus.get("readyReplicas") or 0)
        + int(cstatus.get("readyReplicas") or 0),
        "selector": selector,
        "capacity": dict(capacity) if capacity else None,
        "conditions": merge_conditions(conds, old_status.get("conditions") or [], now),
    }
    if rollout is not None:
        out["rollout"] = dict(rollout)
    return out


def prefill_status(deployment: Mapping[str, Any] | None, desired: int) -> dict[str, int]:
    """status.prefill: the prefill role's desired replicas and its Deployment's ready ones."""
    ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
    return {"replicas": desired, "readyReplicas": ready}


def status_patch(
    desired: Mapping[str, Any], old_status: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The merge patch that brings `old_status` to `desired`, or None when nothing changed."""
    old_status = old_status or {}
    changed = {key: value for key, value in desired.items() if old_status.get(key) != value}
    if "rollout" in changed and isinstance(old_status.get("rollout"), Mapping):
        changed["rollout"] = merge_patch(old_status["rollout"], changed["rollout"])
    return changed or None


def transitions(
    old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]
) -> list[tuple[str, str, str]]:
    """Kubernetes Events (type, reason, message) for conditions that changed status or reason."""
    previous = {c.get("type"): c for c in old}
    events = []
    for cond in new:
        before = previous.get(cond["type"]) or {}
        if (before.get("status"), before.get("reason")) == (cond["status"], cond["reason"]):
            continue
        if cond["type"] == "Ready" and cond["status"] == "True":
            events.append(("Normal", "Ready", cond["message"]))
        elif cond["type"] == "Degraded" and cond["status"] == "True":
            events.append(("Warning", cond["reason"], cond["message"]))
        elif cond["type"] == "Degraded" and before.get("status") == "True":
            events.append(("Normal", "Recovered", "no problems found"))
    return events
