"""One reconcile of one LLMDeployment: observe -> plan -> apply -> status.

This is the I/O shell around the pure parts (builders, plan, status). It is
idempotent: with nothing changed it only reads, so it can run on every
trigger (create, update, resume, a child's event, the resync timer).

Transient API errors propagate as `ApiError` (the kopf handlers turn them
into `kopf.TemporaryError`, which retries with backoff). Everything else that
goes wrong is a `Problem` reported in `status.conditions`: the operator keeps
running and other LLMDeployments are untouched.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubellm import api, capacity, contracts, manifests

from . import builders, rollout, status
from .client import ApiError, Client
from .plan import Action, Plan, Ref, plan

log = logging.getLogger(__name__)

# emit(body, type, reason, message): post a Kubernetes Event about `body`.
Emit = Callable[[Mapping[str, Any], str, str, str], None]
# figures(namespace, deployment, served name): the gateway's cumulative counters per
# revision of one model, or None when they cannot be read (the canary analysis waits).
Figures = Callable[[str, str, str], Awaitable[Mapping[str, rollout.Counters] | None]]


def _epoch() -> float:
    return datetime.datetime.now(datetime.UTC).timestamp()


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _no_events(body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    pass


@dataclass
class Outcome:
    """What one reconcile did; for logs and tests."""

    plan: Plan | None = None
    problems: list[status.Problem] = field(default_factory=list)
    status_patch: dict[str, Any] | None = None
    rollout: rollout.Decision | None = None


def _parse(body: Mapping[str, Any]) -> api.LLMDeployment:
    document = {k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
    return manifests.parse(document, f"{api.KIND} {body['metadata'].get('name')}")


async def _observe(
    client: Client, llmd: api.LLMDeployment, options: builders.Options, had_prefill: bool = False
) -> dict[Ref, Any]:
    observed: dict[Ref, Any] = {}
    ns = llmd.metadata.namespace
    installed = {
        "PodMonitor": options.podmonitor,
        "InferencePool": options.inference_pool,
        "HTTPRoute": options.inference_pool and options.http_route,
        builders.LWS_KIND: options.leader_worker_set,
    }
    for api_version, kind in builders.CHILD_KINDS:
        if not installed.get(kind, True):
            continue
        name = builders.child_name(llmd, kind)
        observed[Ref(api_version, kind, ns, name)] = await client.get(api_version, kind, ns, name)
    if builders.split(llmd) or had_prefill:  # the prefill role's: read where they may exist
        for api_version, kind in builders.PREFILL_KINDS:
            ref = Ref(api_version, kind, ns, builders.prefill_name(llmd))
            observed[ref] = await client.get(api_version, kind, ns, ref.name)
    if options.inference_pool:  # a pool's own picker: read where one may exist, to delete it
        name = builders.picker_name(llmd)
        for api_version, kind in builders.PICKER_KINDS:
            ref = Ref(api_version, kind, ns, name)
            observed[ref] = await client.get(api_version, kind, ns, name)
    return observed


async def _apply(
    client: Client, the_plan: Plan, emit: Emit, body: Mapping[str, Any]
) -> tuple[dict[Ref, Any], list[status.Problem]]:
    """Execute the plan; return the objects the server answered with, and permanent failures."""
    applied: dict[Ref, Any] = {}
    problems = []
    for action in the_plan.actions:
        ref = action.ref
        try:
            if action.verb == "delete":
                await client.delete(ref.api_version, ref.kind, ref.namespace, ref.name)
                applied[ref] = None
                emit(body, "Normal", "Deleted", f"deleted {ref}: no longer wanted by the spec")
            elif action.verb == "scale":
                applied[ref] = await client.patch_merge(
                    ref.api_version, ref.kind, ref.namespace, ref.name,
                    {"spec": {"replicas": action.replicas}},
                )  # fmt: skip
                emit(body, "Normal", "Scaled", f"scaled {ref} to {action.replicas} replicas "
                     "(the canary rollout's split)")  # fmt: skip
            else:
                assert action.body is not None
                applied[ref] = await client.apply(action.body)
                if action.verb == "create":
                    emit(body, "Normal", "Created", f"created {ref}")
                else:
                    emit(body, "Normal", "Updated", f"updated {ref} to match the spec")
        except ApiError as error:
            if error.transient:
                raise
            problems.append(status.Problem("ApplyFailed", f"cannot {action.verb} {ref}: {error}"))
    return applied, problems


async def _fallback_problems(client: Client, llmd: api.LLMDeployment) -> list[status.Problem]:
    fallback = llmd.spec.fallback
    if fallback is None or fallback.api_key_secret_ref is None:
        return []
    ref = fallback.api_key_secret_ref
    secret = await client.get("v1", "Secret", llmd.metadata.namespace, ref.name)
    if secret is None:
        return [
            status.Problem(
                "FallbackSecretMissing",
                f"Secret {llmd.metadata.namespace}/{ref.name} named by "
                "spec.fallback.apiKeySecretRef does not exist; create it with key "
                f"{ref.key!r}",
            )
        ]
    if ref.key not in (secret.get("data") or {}) and ref.key not in (
        secret.get("stringData") or {}
    ):
        return [
            status.Problem(
                "FallbackSecretMissing",
                f"Secret {llmd.metadata.namespace}/{ref.name} has no key {ref.key!r} "
                "(spec.fallback.apiKeySecretRef.key)",
            )
        ]
    return []


async def _tenants(
    client: Client, llmd: api.LLMDeployment, options: builders.Options
) -> tuple[str | None, list[status.Problem]]:
    """The sha256 of the tenants file that spec.routing.inferencePool.endpointPicker
    .tenantsSecretRef names (the picker pods' checksum annotation: a change rolls them), or
    why it cannot be mounted. Only for a picker the operator runs itself."""
    wanted = llmd.spec.routing.inference_pool
    ref = wanted.endpoint_picker.tenants_secret_ref if wanted is not None else None
    if ref is None or not options.inference_pool or not builders.runs_own_picker(llmd, options):
        return None, []
    where = f"Secret {llmd.metadata.namespace}/{ref.name}"
    field = "spec.routing.inferencePool.endpointPicker.tenantsSecretRef"
    secret = await client.get("v1", "Secret", llmd.metadata.namespace, ref.name)
    if secret is None:
        return None, [
            status.Problem(
                "TenantsSecretMissing",
                f"{where} named by {field} does not exist; create it with key {ref.key!r} "
                "(the tenants file); the picker's pods wait for it",
            )
        ]
    value = (secret.get("data") or {}).get(ref.key)
    if value is None:
        value = (secret.get("stringData") or {}).get(ref.key)
    if value is None:
        return None, [
            status.Problem("TenantsSecretMissing", f"{where} has no key {ref.key!r} ({field}.key)")
        ]
    return hashlib.sha256(str(value).encode()).hexdigest(), []


def _capacity(llmd: api.LLMDeployment) -> tuple[dict[str, Any] | None, list[status.Problem]]:
    try:
        return capacity.for_spec(llmd.spec), []
    except capacity.CapacityError as error:
        return None, [status.Problem("CapacityPlanFailed", f"status.capacity: {error}")]


def _canary_refs(llmd: api.LLMDeployment, prefill: bool = False) -> list[Ref]:
    """The canary revision's children; `prefill`: the prefill role's too (after the others)."""
    ns = llmd.metadata.namespace
    refs = [
        Ref(v, kind, ns, builders.canary_child_name(llmd, kind))
        for v, kind in builders.canary_kinds(llmd)
    ]
    if prefill:
        name = builders.prefill_name(llmd, canary=True)
        refs += [Ref(v, kind, ns, name) for v, kind in builders.PREFILL_CANARY_KINDS]
    return refs


def _rolled_out(deployment: Mapping[str, Any] | None) -> bool:
    """A Deployment (or LeaderWorkerSet) whose controller has seen its template and has
    every replica (group) updated and ready."""
    if deployment is None:
        return False
    want = int((deployment.get("spec") or {}).get("replicas") or 0)
    dstatus = deployment.get("status") or {}
    return (
        status.generation_observed(deployment)
        and int(dstatus.get("updatedReplicas") or 0) >= want
        and int(dstatus.get("readyReplicas") or 0) >= want
    )


def _template_revision(deployment: Mapping[str, Any] | None) -> str | None:
    """The revision a Deployment's pod template (a LeaderWorkerSet's leader template) runs."""
    if deployment is None:
        return None
    spec = deployment.get("spec") or {}
    template = (
        spec.get("template") or (spec.get("leaderWorkerTemplate") or {}).get("leaderTemplate") or {}
    )
    return ((template.get("metadata") or {}).get("annotations") or {}).get(
        builders.SPEC_HASH_ANNOTATION
    )


def _replicas(workload: Mapping[str, Any]) -> int:
    return int((workload.get("spec") or {}).get("replicas") or 0)


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    return value


def _needs_pods(deployment: Mapping[str, Any] | None, desired: int) -> bool:
    """Pods are read only while something is not yet right (a cheap steady state)."""
    if deployment is None:
        return False
    dstatus = deployment.get("status") or {}
    ready = int(dstatus.get("readyReplicas") or 0)
    updated = int(dstatus.get("updatedReplicas") or 0)
    return ready < desired or updated < desired


async def reconcile(
    client: Client,
    namespace: str,
    name: str,
    *,
    podmonitor: bool = False,
    inference_pool: bool = False,
    http_route: bool = False,
    leader_worker_set: bool = False,
    picker: builders.PickerOptions | None = None,
    emit: Emit = _no_events,
    now: Callable[[], str] = utc_now,
    figures: Figures | None = None,
    clock: Callable[[], float] | None = None,
) -> Outcome | None:
    """Bring the children and status of one LLMDeployment in line; None when it is gone."""
    body = await client.get(api.API_VERSION, api.KIND, namespace, name)
    if body is None or body.get("metadata", {}).get("deletionTimestamp"):
        return None  # deleted: owner references let the garbage collector remove children
    meta = body["metadata"]
    generation = meta.get("generation")
    old_status = body.get("status") or {}
    outcome = Outcome()

    try:
        llmd = _parse(body)
    except manifests.ManifestError as error:
        outcome.problems.append(status.Problem("InvalidSpec", str(error)))
        llmd = None

    deployment = None
    prefill_status: dict[str, Any] | None = None
    rollout_status: dict[str, Any] | None = old_status.get("rollout")
    progressing = None
    canary_deployment = None
    selector = old_status.get("selector") or ""
    desired_replicas = int((body.get("spec") or {}).get("replicas") or 0)
    cap = None
    extra_conditions: list[dict[str, Any]] = []
    if llmd is not None:
        desired_replicas = llmd.spec.replicas
        selector = builders.selector_string(llmd)
        cap, cap_problems = _capacity(llmd)
        outcome.problems += cap_problems
        options = builders.Options(
            owner_uid=meta.get("uid"),
            podmonitor=podmonitor,
            inference_pool=inference_pool,
            http_route=http_route,
            leader_worker_set=leader_worker_set,
            picker=picker or builders.PickerOptions(),
        )
        checksum, tenants_problems = await _tenants(client, llmd, options)
        outcome.problems += tenants_problems
        if checksum is not None:
            options = dataclasses.replace(options, tenants_checksum=checksum)
        try:
            desired = builders.build(llmd, options)
        except builders.SpecError as error:
            outcome.problems.append(status.Problem(error.reason, str(error)))
            desired = None
        had_prefill = old_status.get("prefill") is not None
        observed = await _observe(client, llmd, options, had_prefill)
        prefill_ref = Ref("apps/v1", "Deployment", namespace, builders.prefill_name(llmd))
        deployment_ref = Ref(*builders.workload_kind(llmd), namespace,
                             builders.workload_name(llmd))  # fmt: skip
        deployment = observed.get(deployment_ref)
        old_rollout = old_status.get("rollout") or {}
        canary_refs = _canary_refs(llmd, builders.split(llmd) or had_prefill)
        if llmd.spec.rollout.strategy == "Canary" or old_rollout.get("canaryRevision"):
            for ref in canary_refs:
                if ref.kind == builders.LWS_KIND and not options.leader_worker_set:
                    continue  # read only where a canary may exist
                observed[ref] = await client.get(ref.api_version, ref.kind, ref.namespace,
                                                 ref.name)  # fmt: skip
        canary_live = observed.get(canary_refs[1])
        action = (meta.get("annotations") or {}).get(contracts.ROLLOUT_ACTION_ANNOTATION)
        revision = contracts.revision(llmd)
        active = llmd.spec.rollout.strategy == "Canary" and _template_revision(deployment) not in (
            None, revision
        )  # fmt: skip
        counters = None
        if figures is not None and (active or old_rollout.get("phase") == "Promoting"):
            counters = await figures(namespace, name, llmd.served_name)
        decision = rollout.decide(
            llmd.spec,
            old_rollout,
            rollout.Observation(
                desired_revision=revision,
                stable_revision=_template_revision(deployment),
                stable_ready=_rolled_out(deployment),
                canary_ready=_template_revision(canary_live) == revision
                and _rolled_out(canary_live)
                and int(((canary_live or {}).get("status") or {}).get("readyReplicas") or 0) > 0,
                now=(clock or _epoch)(),
                counters=counters,
                action=action if action in contracts.ROLLOUT_ACTIONS else None,
            ),
        )
        outcome.rollout = decision
        # The prefill role's (stable, canary) replicas follow the canary's traffic weight as
        # decode's do, so a canary with decode replicas has a prefill replica of its revision.
        prefill_split = (0, 0)
        if builders.split(llmd):
            weight = int((decision.status or {}).get("canaryWeight") or 0)
            prefill = builders.prefill_replicas(llmd)
            prefill_split = (
                rollout.split(prefill, max(weight, 1)) if decision.canary_replicas else (prefill, 0)
            )
        if desired is not None:
            extra_actions: list[Action] = []
            wanted_children = list(desired)
            seen_children = dict(observed)
            if decision.mode == "canary":
                # The stable revision keeps its engine spec and pod template: only its
                # replicas follow the split.
                configmap = builders.spec_configmap_name(llmd)
                stable_refs = {deployment_ref, Ref("v1", "ConfigMap", namespace, configmap)}
                prefill_live = observed.get(prefill_ref)
                if builders.split(llmd) and prefill_live is not None:
                    stable_refs.add(prefill_ref)  # its template stays too; replicas split
                    if _replicas(prefill_live) != prefill_split[0]:
                        extra_actions.append(Action("scale", prefill_ref, None, prefill_split[0]))
                wanted_children = [c for c in desired if Ref.of(c) not in stable_refs]
                for ref in stable_refs:
                    seen_children.pop(ref, None)
                if deployment is not None and (
                    int((deployment.get("spec") or {}).get("replicas") or 0)
                    != decision.stable_replicas
                ):
                    extra_actions.append(Action("scale", deployment_ref, None,
                                                decision.stable_replicas))  # fmt: skip
            elif decision.mode == "rolling":
                pass  # canary children observed are no longer wanted: the plan deletes them
            if decision.mode in ("canary", "promoting"):
                wanted_children += builders.build_canary(
                    llmd, decision.canary_replicas, options, prefill_split[1]
                )
            outcome.plan = plan(wanted_children, seen_children, meta.get("uid", ""))
            outcome.plan.actions.extend(extra_actions)
            applied, apply_problems = await _apply(client, outcome.plan, emit, body)
            outcome.problems += apply_problems
            deployment = applied.get(deployment_ref, deployment)
            if builders.split(llmd):
                prefill_status = status.prefill_status(
                    applied.get(prefill_ref, observed.get(prefill_ref)),
                    builders.prefill_replicas(llmd),
                )
            if decision.mode != "rolling":
                canary_deployment = applied.get(canary_refs[1], canary_live)
            pool_ref = Ref(builders.INFERENCE_POOL_API_VERSION, "InferencePool", namespace,
                           builders.engine_name(llmd))  # fmt: skip
            pool = applied.get(pool_ref, observed.get(pool_ref))
            wanted = llmd.spec.routing.inference_pool
            condition = status.inference_pool_condition(
                wanted is not None, inference_pool, bool(wanted and wanted.parent_refs),
                http_route, pool, generation,
            )  # fmt: skip
            if condition is not None:
                extra_conditions.append(condition)
            outcome.problems += [
                status.Problem("NameConflict", f"{ref} exists and is not owned by {name}")
                for ref in outcome.plan.conflicts
            ]
        if decision.clear_action:
            await client.patch_merge(
                api.API_VERSION, api.KIND, namespace, name,
                {"metadata": {"annotations": {contracts.ROLLOUT_ACTION_ANNOTATION: None}}},
            )  # fmt: skip
        for kind, reason, message in decision.events:
            emit(body, kind, reason, message)
        rollout_status = _drop_none(decision.status)
        progressing, rollout_extra = status.rollout_conditions(
            rollout_status.get("phase"), rollout_status.get("message", ""),
            decision.rolled_back, llmd.spec.rollout.strategy == "Canary", generation,
        )  # fmt: skip
        extra_conditions += rollout_extra
        if decision.mode == "canary":
            desired_replicas = decision.stable_replicas
        outcome.problems += await _fallback_problems(client, llmd)
        if _needs_pods(deployment, desired_replicas):
            pods = await client.list("v1", "Pod", namespace, builders.selector_labels(llmd))
            outcome.problems += status.pod_problems(pods, llmd.spec.resources.gpu.resource_name)

    new_status = status.desired_status(
        generation=generation,
        desired_replicas=desired_replicas,
        selector=selector,
        deployment=deployment,
        problems=outcome.problems,
        capacity=cap,
        old_status=old_status,
        extra_conditions=extra_conditions,
        now=now(),
        rollout=rollout_status,
        progressing=progressing,
        canary=canary_deployment,
    )
    if prefill_status is not None or old_status.get("prefill") is not None:
        new_status["prefill"] = prefill_status  # None: spec.prefill was removed
    outcome.status_patch = status.status_patch(new_status, old_status)
    if outcome.status_patch is not None:
        await client.patch_status(namespace, name, outcome.status_patch)
        for kind, reason, message in status.transitions(
            old_status.get("conditions") or [], new_status["conditions"]
        ):
            emit(body, kind, reason, message)
    return outcome
