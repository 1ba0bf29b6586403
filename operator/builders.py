"""Pure builders: one `LLMDeployment` in, the Kubernetes objects that run it out.

No I/O here. Every function returns plain dicts ready for server-side apply,
so `kubellm render`, the reconciler and the tests all see the same objects.

Children of an `LLMDeployment` named N (all in its namespace, all owned by it):
- ConfigMap `N-engine-spec`: the engine's view of the spec, mounted at SPEC_DIR.
- Deployment `N-engine`: the vLLM engine pods; or, when a replica spans pods
  (spec.resources.nodes > 1), LeaderWorkerSet `N-lws` (leaderworkerset.x-k8s.io/v1): one
  group of nodes pods per replica, the leader serving the API, the workers joining it
  headless. Its own headless Service (named like it) gives the pods their DNS names.
- Service `N-engine`: the engine port, named `http`; EndpointSlices copy its labels,
  which is how the gateway finds ready replicas (a multi-node replica's leader only).
- PodDisruptionBudget `N-engine`: at most one engine pod evicted at a time, when
  the deployment can run more than one replica.
- PodMonitor `N-engine`: only when the Prometheus Operator's CRD is installed.
- InferencePool `N-engine` and HTTPRoute `N-engine`: spec.routing.inferencePool, where the
  Inference Extension's (and Gateway API's) CRDs are installed; with them, unless the spec
  names a picker Service or the operator is told of a shared one, the pool's own endpoint
  picker: Deployment and Service `N-epp` (`kubellm epp --pool-name N-engine`), and the
  ServiceAccount, Role and RoleBinding `N-epp` that let it read this namespace's
  LLMDeployments and EndpointSlices, nothing else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kubellm.operator import plan

from kubellm import __version__, api, contracts, kv_tiers, sources
from kubellm.contracts import DEPLOYMENT_LABEL, PORT_NAME, engine_spec_json

FIELD_MANAGER = "kubellm-operator"
SPEC_HASH_ANNOTATION = "kubellm.io/spec-hash"

ENGINE_CONTAINER = "engine"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
SHM_DIR = "/dev/shm"
TMP_DIR = "/tmp"
RUN_AS_USER = 1000
# Seconds a pod keeps serving after it is marked for removal, so that endpoints
# (and the gateway) drop it before the engine gets SIGTERM.
MAX_DRAIN_DELAY_SECONDS = 15

PODMONITOR_API_VERSION = "monitoring.coreos.com/v1"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
# A multi-node replica's pods: kubellm's role label (the LeaderWorkerSet controller adds its
# own, leaderworkerset.sigs.k8s.io/worker-index, 0 on the leader).
ROLE_LABEL = contracts.ROLE_LABEL  # also marks a multi-node group's leader and workers
LEADER, WORKER = "leader", "worker"


class SpecError(ValueError):
    """A spec the operator cannot realise; `reason` is the condition reason to report."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _default_picker_resources() -> dict[str, Any]:
    return {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


@dataclass(frozen=True)
class PickerOptions:
    """How the operator runs the endpoint picker of a pool whose spec names none
    (`kubellm operator --epp-*`; the chart's operator.endpointPicker)."""

    # A shared picker Service (in each pool's namespace) that pools naming none use; the
    # operator then runs no picker of its own (the chart's operator.endpointPicker.mode
    # shared). None: one picker per pool.
    shared: str | None = None
    image: str = f"ghcr.io/kubellm/kubellm:{__version__}"
    image_pull_policy: str = "IfNotPresent"
    # Where the picker sends overflow (the chart's gateway Service, which holds the
    # fallback API keys): `kubellm epp --fallback-forwarder`. None: overflow is refused.
    fallback_forwarder: str | None = None
    resources: Mapping[str, Any] = field(default_factory=_default_picker_resources)
    # The quota store the pickers share with the chart's gateway (`kubellm epp
    # --quota-redis`; the chart's gateway.quotaRedis). None: each picker counts alone.
    quota_redis: str | None = None


@dataclass(frozen=True)
class Options:
    """What the builders need beyond the spec."""

    owner_uid: str | None = None  # None: no owner reference (`kubellm render`)
    podmonitor: bool = False  # the Prometheus Operator's PodMonitor CRD is installed
    # The Gateway API Inference Extension's InferencePool CRD / Gateway API's HTTPRoute CRD
    # are installed (`kubellm render` assumes both).
    inference_pool: bool = False
    http_route: bool = False
    picker: PickerOptions = field(default_factory=PickerOptions)
    # sha256 of the tenants file the spec's endpointPicker.tenantsSecretRef names (read by
    # the reconciler): the picker pods' checksum/tenants annotation, so a change rolls them
    tenants_checksum: str | None = None
    # The LeaderWorkerSet CRD is installed (`kubellm render` assumes it); without it a
    # spec whose replica spans pods is refused (LeaderWorkerSetMissing).
    leader_worker_set: bool = True


# --------------------------------------------------------------------------- names and labels


def engine_name(llmd: api.LLMDeployment) -> str:
    return f"{llmd.metadata.name}-engine"


def spec_configmap_name(llmd: api.LLMDeployment, canary: bool = False) -> str:
    return f"{llmd.metadata.name}-engine-spec" + ("-canary" if canary else "")


def canary_name(llmd: api.LLMDeployment) -> str:
    """The canary revision's Deployment and Service (spec.rollout.strategy Canary)."""
    return f"{llmd.metadata.name}-engine-canary"


def canary_labels(llmd: api.LLMDeployment) -> dict[str, str]:
    """The canary pods' selector: the engine selector plus the canary track."""
    return {**selector_labels(llmd), contracts.TRACK_LABEL: contracts.CANARY_TRACK}


def split(llmd: api.LLMDeployment) -> bool:
    """spec.prefill is set: the engines run as a prefill role and a decode role."""
    return llmd.spec.prefill is not None


def decode_role(llmd: api.LLMDeployment) -> str | None:
    """The role label of the main (decode) objects: decode with spec.prefill, else none (an
    unlabelled engine serves both phases)."""
    return contracts.DECODE_ROLE if split(llmd) else None


def prefill_name(llmd: api.LLMDeployment, canary: bool = False) -> str:
    """The prefill role's Deployment, Service and PDB (`-canary`: its canary revision's)."""
    return f"{llmd.metadata.name}-prefill" + ("-canary" if canary else "")


def prefill_replicas(llmd: api.LLMDeployment, decode_replicas: int | None = None) -> int:
    """The prefill role's replicas: spec.prefill.replicas, but none while the decode role
    has none (a prefill replica alone serves nothing: the pair scales to zero together)."""
    prefill = llmd.spec.prefill
    assert prefill is not None
    decode = llmd.spec.replicas if decode_replicas is None else decode_replicas
    return prefill.replicas if decode > 0 else 0


def with_role(labels: Mapping[str, str], role: str | None) -> dict[str, str]:
    return {**labels, contracts.ROLE_LABEL: role} if role else dict(labels)


def selector_labels(llmd: api.LLMDeployment) -> dict[str, str]:
    """The immutable pod selector of the engine Deployment (and its Service and PDB)."""
    return contracts.selector_labels(llmd.metadata.name)


def labels(llmd: api.LLMDeployment) -> dict[str, str]:
    """Labels on every child; the Service's reach the EndpointSlices the gateway watches."""
    return contracts.engine_labels(llmd.metadata.name)


def multi_node(llmd: api.LLMDeployment) -> bool:
    """A replica spans pods: it runs as a LeaderWorkerSet group, not a Deployment's pod."""
    return llmd.spec.resources.nodes > 1


def workers_serve(llmd: api.LLMDeployment) -> bool:
    """Every pod of a multi-node group serves API servers: its data-parallel ranks are
    endpoints of their own (contracts.dp_ranks_per_pod), not only the leader's."""
    return multi_node(llmd) and contracts.dp_ranks_per_pod(llmd.spec) > 0


def serving_labels(
    llmd: api.LLMDeployment, canary: bool = False, *, leaders: bool = False
) -> dict[str, str]:
    """The pods that serve the API (the Service's, the pool's): every engine pod, or a
    multi-node replica's leader only (its workers have no HTTP server) unless its workers
    serve data-parallel ranks. `leaders`: one pod per replica (status.selector's)."""
    chosen = canary_labels(llmd) if canary else selector_labels(llmd)
    if multi_node(llmd) and (leaders or not workers_serve(llmd)):
        return {**chosen, ROLE_LABEL: LEADER}
    return chosen


def selector_string(llmd: api.LLMDeployment) -> str:
    """`status.selector`: the label selector of one pod per replica (the leader when a
    replica spans pods), for the scale subresource."""
    return ",".join(f"{k}={v}" for k, v in sorted(serving_labels(llmd, leaders=True).items()))


def container_ports(llmd: api.LLMDeployment) -> list[dict[str, Any]]:
    """A serving pod's API ports: `http`, and `http-dp<i>` for each further data-parallel
    rank it serves (contracts.serving_ports)."""
    ports = contracts.serving_ports(llmd.spec)
    return [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports]


def owner_reference(llmd: api.LLMDeployment, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": llmd.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(llmd: api.LLMDeployment, name: str, options: Options) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": llmd.metadata.namespace,
        "labels": labels(llmd),
    }
    if options.owner_uid:
        meta["ownerReferences"] = [owner_reference(llmd, options.owner_uid)]
    return meta


# --------------------------------------------------------------------------- engine spec


def spec_hash(llmd: api.LLMDeployment) -> str:
    """Hash of the engine identity (the engine spec less its adapters, which load at runtime);
    a pod-template annotation, so a change rolls out."""
    return contracts.revision(llmd)


def spec_configmap(
    llmd: api.LLMDeployment, options: Options = Options(), canary: bool = False
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(llmd, spec_configmap_name(llmd, canary), options),
        "data": {sources.SPEC_FILENAME: engine_spec_json(llmd)},
    }


# --------------------------------------------------------------------------- checks


# Arguments the launcher derives from the spec; repeating them in extraArgs is a conflict.
OWNED_ENGINE_ARGS = frozenset(api.OWNED_ENGINE_ARGS)


def check(llmd: api.LLMDeployment, options: Options = Options()) -> None:
    """Raise SpecError for a spec that validates but that the operator cannot realise."""
    source = sources.parse_source(llmd.spec.model.source)
    if source.scheme == "s3":
        raise SpecError(
            "UnsupportedModelSource",
            "spec.model.source: s3:// sources are not supported by the operator yet; "
            "copy the weights to a PVC and use pvc://claim/path",
        )
    for adapter in llmd.spec.adapters:
        check_adapter(adapter, llmd.spec.model.source)
    problem = api.extra_args_problem(llmd.spec.engine.extra_args)  # vLLM's spellings too
    if problem is not None:
        raise SpecError("InvalidEngineArguments", problem)
    ranks = contracts.dp_ranks_per_pod(llmd.spec)
    if ranks > contracts.MAX_RANK_PORTS:
        raise SpecError(
            "TooManyRankEndpoints",
            f"spec.engine.dataParallelSize: {ranks} data-parallel ranks per pod, each an "
            f"endpoint on a port of its own; an InferencePool lists at most "
            f"{contracts.MAX_RANK_PORTS} ports (raise tensorParallelSize or use more nodes)",
        )
    if ranks and llmd.spec.routing.prefix_index == "precise":
        raise SpecError(
            "UnsupportedRankKVEvents",
            "spec.routing.prefixIndex precise with data-parallel ranks as endpoints: each "
            "rank publishes KV events on a port of its own, which kubellm does not wire yet; "
            "use prefixIndex approximate",
        )
    if split(llmd) and any(a.split("=", 1)[0] == "--kv-transfer-config"
                           for a in llmd.spec.engine.extra_args):  # fmt: skip
        raise SpecError(
            "InvalidEngineArguments",
            "spec.engine.extraArgs: --kv-transfer-config is set by the operator from "
            "spec.prefill.kvConnector; put connector settings in its extraConfig",
        )
    if multi_node(llmd) and not options.leader_worker_set:
        raise SpecError(
            "LeaderWorkerSetMissing",
            f"spec.resources.nodes is {llmd.spec.resources.nodes}: a replica that spans pods "
            f"runs as a LeaderWorkerSet ({LWS_API_VERSION}), whose CRD is not installed; "
            "install the LeaderWorkerSet controller (docs/operations.md, 'Serving a model "
            "larger than one node')",
        )


def check_adapter(adapter: api.Adapter, model_source: str) -> None:
    """An adapter the engine pod could not load: s3:// and hf://...@revision (the launcher's
    refusals), and pvc:// on another claim than the model's: the pod mounts the model's
    claim only, and mounting another would change the pod template (a restart per new
    claim), so adapters on PVCs share the model's claim."""
    try:
        sources.adapter_path(adapter.source, model_source)
    except ValueError as error:
        message = str(error).replace("spec.adapters", f"spec.adapters {adapter.name}:", 1)
        raise SpecError("UnsupportedAdapterSource", message) from None
    parsed, model = sources.parse_source(adapter.source), sources.parse_source(model_source)
    if parsed.scheme == "pvc" and (model.scheme != "pvc" or parsed.location != model.location):
        raise SpecError(
            "UnsupportedAdapterSource",
            f"spec.adapters {adapter.name}: {adapter.source!r} is on another claim than the "
            "model's; put adapters on the model's PVC (pvc://<model claim>/adapters/...), "
            "or use hf:// or file://",
        )


# --------------------------------------------------------------------------- deployment


def _resources(llmd: api.LLMDeployment, pd_role: str | None = None) -> dict[str, Any]:
    prefill = llmd.spec.prefill
    res = llmd.spec.resources
    if pd_role == contracts.PREFILL_ROLE and prefill is not None and prefill.resources:
        res = prefill.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if res.cpu:
        requests["cpu"] = res.cpu
    if res.memory:
        requests["memory"] = limits["memory"] = _with_host_tier(llmd, res.memory)
    elif llmd.spec.engine.kv_offload is not None:  # no limit to OOM-kill the engine at
        requests["memory"] = _with_host_tier(llmd, "0")
    if res.gpu.count > 0:
        requests[res.gpu.resource_name] = str(res.gpu.count)
        limits[res.gpu.resource_name] = str(res.gpu.count)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _with_host_tier(llmd: api.LLMDeployment, memory: str) -> str:
    """resources.memory plus this pod's share of the host-memory KV tier (vLLM pins it:
    the scheduler must reserve it), in Mi; `memory` unchanged without a tier."""
    offload = llmd.spec.engine.kv_offload
    base = plan.quantity(memory)
    if offload is None or base is None:
        return memory
    host = Decimal(repr(offload.host_gib)) * 2**30 / llmd.spec.resources.nodes
    return f"{math.ceil((base + host) / 2**20)}Mi"


def _disk_volume(disk: api.DiskTier) -> dict[str, Any]:
    """The disk tier's volume: the claim, or an emptyDir capped at its size."""
    if disk.claim_name:
        return {"name": "kv-offload", "persistentVolumeClaim": {"claimName": disk.claim_name}}
    return {"name": "kv-offload", "emptyDir": {"sizeLimit": f"{math.ceil(disk.size_gib * 1024)}Mi"}}


def _model_volume(llmd: api.LLMDeployment) -> dict[str, Any]:
    source = sources.parse_source(llmd.spec.model.source)
    if source.scheme == "pvc":
        return {"name": "model", "persistentVolumeClaim": {"claimName": source.location}}
    return {"name": "model", "emptyDir": {}}


def _env(llmd: api.LLMDeployment) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "HOME", "value": TMP_DIR}]
    if sources.parse_source(llmd.spec.model.source).scheme == "hf":
        env.append({"name": "HF_HOME", "value": sources.HF_CACHE_DIR})
    if split(llmd):  # the KV connector's side channel listens on the pod's address
        env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return env


def _probes(port_name: str) -> dict[str, Any]:
    """Startup allows 30 minutes for downloading and loading weights; then fast checks."""

    def get() -> dict[str, Any]:
        return {"httpGet": {"path": HEALTH_PATH, "port": port_name}}

    return {
        "startupProbe": {
            **get(),
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 180,
        },
        "readinessProbe": {
            **get(),
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
            "successThreshold": 1,
        },
        "livenessProbe": {
            **get(),
            "periodSeconds": 15,
            "timeoutSeconds": 10,
            "failureThreshold": 4,
        },
    }


def drain_delay_seconds(grace_seconds: int) -> int:
    """How long preStop waits before SIGTERM: long enough for endpoints to drop the pod,
    short enough to leave most of the grace period for in-flight generations."""
    return min(MAX_DRAIN_DELAY_SECONDS, grace_seconds // 4)


def _rollout(llmd: api.LLMDeployment) -> dict[str, Any]:
    rollout = llmd.spec.rollout
    return {
        "type": "RollingUpdate",
        "rollingUpdate": {
            "maxSurge": rollout.max_surge,
            "maxUnavailable": rollout.max_unavailable,
        },
    }


def engine_command(llmd: api.LLMDeployment, pd_role: str | None = None) -> list[str]:
    """The engine launcher's command line (the contract with kubellm.engine); `pd_role`:
    prefill or decode, the launcher renders that role's KV connector and overrides."""
    role = ["--role", pd_role] if pd_role else []
    return [
        "kubellm",
        "engine",
        "--spec",
        sources.SPEC_PATH,
        "--port",
        str(llmd.spec.engine.port),
        "--host",
        "0.0.0.0",
        *role,
    ]


def kv_event_ports(llmd: api.LLMDeployment) -> list[dict[str, Any]]:
    """With spec.routing.prefixIndex precise, the engine's KV-event publisher and its replay
    port (the launcher's kv_events_args), named so the gateway's policy can allow them."""
    routing = llmd.spec.routing
    if routing.prefix_index != "precise":
        return []
    return [
        {"name": "kv-events", "containerPort": routing.kv_events_port, "protocol": "TCP"},
        {"name": "kv-replay", "containerPort": routing.kv_events_port + 1, "protocol": "TCP"},
    ]


def _pod_template(
    llmd: api.LLMDeployment, *, canary: bool, role: str | None, pd_role: str | None = None
) -> dict[str, Any]:
    """The engine pod template: one Deployment pod (`role` None), or a multi-node
    replica's leader (serves the API: its port, probes and drain delay) or worker (joins
    the leader headless: no HTTP server, so no port and no probes; ready once running, and
    the group is ready when the leader is, which needs every worker)."""
    spec = llmd.spec
    port = spec.engine.port
    grace = spec.termination_grace_period_seconds
    serving = role != WORKER or workers_serve(llmd)
    disk = spec.engine.kv_offload.disk if spec.engine.kv_offload else None
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": spec.engine.image,
        "imagePullPolicy": "IfNotPresent",
        "command": engine_command(llmd, pd_role),
        "env": _env(llmd),
        "resources": _resources(llmd, pd_role),
        "volumeMounts": [
            {"name": "engine-spec", "mountPath": sources.SPEC_DIR, "readOnly": True},
            {"name": "model", "mountPath": sources.MODEL_ROOT},
            {"name": "dshm", "mountPath": SHM_DIR},
            {"name": "tmp", "mountPath": TMP_DIR},
            *([{"name": "kv-offload", "mountPath": kv_tiers.DISK_DIR}] if disk else []),
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if serving:
        container["ports"] = [*container_ports(llmd), *kv_event_ports(llmd)]
        container.update(_probes(PORT_NAME))
        delay = drain_delay_seconds(grace)
        if delay > 0:
            container["lifecycle"] = {"preStop": {"sleep": {"seconds": delay}}}
    scheduling = spec.scheduling
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {"name": "engine-spec", "configMap": {"name": spec_configmap_name(llmd, canary)}},
            _model_volume(llmd),
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {"name": "tmp", "emptyDir": {}},
            *([_disk_volume(disk)] if disk else []),
        ],
        "terminationGracePeriodSeconds": grace,
        # Service links inject <SERVICE>_PORT variables; vLLM reads VLLM_PORT and breaks.
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in scheduling.tolerations]
    if scheduling.affinity:
        pod_spec["affinity"] = scheduling.affinity
    if scheduling.priority_class_name:
        pod_spec["priorityClassName"] = scheduling.priority_class_name
    revision = spec_hash(llmd)
    pod_labels = labels(llmd)
    if canary:
        pod_labels.update({contracts.TRACK_LABEL: contracts.CANARY_TRACK,
                           contracts.REVISION_LABEL: revision})  # fmt: skip
    if role is not None:
        pod_labels[ROLE_LABEL] = role
    pod_labels = with_role(pod_labels, pd_role)
    annotations = {SPEC_HASH_ANNOTATION: revision}
    if serving:
        annotations.update({"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                            "prometheus.io/path": METRICS_PATH})  # fmt: skip
    return {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod_spec}


def _workload_metadata(llmd: api.LLMDeployment, name: str, options: Options) -> dict[str, Any]:
    metadata = _metadata(llmd, name, options)
    metadata["labels"][contracts.REVISION_LABEL] = spec_hash(llmd)
    return metadata


def engine_deployment(
    llmd: api.LLMDeployment,
    options: Options = Options(),
    *,
    replicas: int | None = None,
    canary: bool = False,
    prefill: bool = False,
) -> dict[str, Any]:
    """The engine Deployment (`canary`: the canary revision's, beside the stable one), with
    `replicas` (default spec.replicas: the rollout splits it between the two). `prefill`:
    the prefill role's (spec.prefill), whose selector adds the role so that it never
    selects decode pods; the decode role's selector stays the one it always had (a
    Deployment's selector is immutable: adding spec.prefill must not recreate it), and
    its pods are labelled decode."""
    spec = llmd.spec
    if prefill:
        pd_role: str | None = contracts.PREFILL_ROLE
        name = prefill_name(llmd, canary)
        default_replicas = prefill_replicas(llmd)
    else:
        pd_role = decode_role(llmd)
        name = canary_name(llmd) if canary else engine_name(llmd)
        default_replicas = spec.replicas
    selector = canary_labels(llmd) if canary else selector_labels(llmd)
    metadata = _workload_metadata(llmd, name, options)
    metadata["labels"] = with_role(metadata["labels"], pd_role)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": default_replicas if replicas is None else replicas,
            "selector": {"matchLabels": with_role(selector, pd_role) if prefill else selector},
            "strategy": _rollout(llmd),
            "revisionHistoryLimit": 3,
            # Past the startup probe's 30 minutes, a stuck rollout is reported.
            "progressDeadlineSeconds": 2400,
            "template": _pod_template(llmd, canary=canary, role=None, pd_role=pd_role),
        },
    }


def lws_name(llmd: api.LLMDeployment, canary: bool = False) -> str:
    """The LeaderWorkerSet's name. Not the engine Service's: the LWS controller creates a
    headless Service of its own name for the pods' DNS names (the leader's address)."""
    return f"{llmd.metadata.name}-{'canary-' if canary else ''}lws"


def engine_leader_worker_set(
    llmd: api.LLMDeployment,
    options: Options = Options(),
    *,
    replicas: int | None = None,
    canary: bool = False,
) -> dict[str, Any]:
    """The engine as a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1): `replicas` groups
    (the scale subresource's unit) of spec.resources.nodes pods. Workers start with the
    leader's pod (LeaderCreated: the leader is only ready once they have joined), and a
    restart of any pod recreates its group (a torch.distributed group does not survive
    losing a rank). Rolling updates replace whole groups, spec.rollout's maxSurge and
    maxUnavailable counted in groups."""
    spec = llmd.spec
    rollout = spec.rollout
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": _workload_metadata(llmd, lws_name(llmd, canary), options),
        "spec": {
            "replicas": spec.replicas if replicas is None else replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {
                    "maxSurge": rollout.max_surge,
                    "maxUnavailable": rollout.max_unavailable,
                },
            },
            "leaderWorkerTemplate": {
                "size": spec.resources.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _pod_template(llmd, canary=canary, role=LEADER),
                "workerTemplate": _pod_template(llmd, canary=canary, role=WORKER),
            },
        },
    }


def workload_kind(llmd: api.LLMDeployment) -> tuple[str, str]:
    """(apiVersion, kind) of the engine workload for this spec's shape."""
    return (LWS_API_VERSION, LWS_KIND) if multi_node(llmd) else ("apps/v1", "Deployment")


def workload_name(llmd: api.LLMDeployment, canary: bool = False) -> str:
    if multi_node(llmd):
        return lws_name(llmd, canary)
    return canary_name(llmd) if canary else engine_name(llmd)


def engine_workload(
    llmd: api.LLMDeployment,
    options: Options = Options(),
    *,
    replicas: int | None = None,
    canary: bool = False,
) -> dict[str, Any]:
    """The engine Deployment, or the LeaderWorkerSet when a replica spans pods."""
    build = engine_leader_worker_set if multi_node(llmd) else engine_deployment
    return build(llmd, options, replicas=replicas, canary=canary)


# --------------------------------------------------------------------------- service, PDB, monitor


def engine_service(
    llmd: api.LLMDeployment,
    options: Options = Options(),
    canary: bool = False,
    prefill: bool = False,
) -> dict[str, Any]:
    """The engine Service (all engine pods, both revisions during a canary rollout), or, with
    `canary`, the canary's: its EndpointSlices carry the revision label, which is how the
    gateway knows which endpoints run the canary. With spec.prefill, one per role: the
    role label on the Service (its EndpointSlices: how the gateway tells the roles apart)
    and in its selector; `prefill` the prefill role's."""
    pd_role = contracts.PREFILL_ROLE if prefill else decode_role(llmd)
    if prefill:
        name = prefill_name(llmd, canary)
    else:
        name = canary_name(llmd) if canary else engine_name(llmd)
    metadata = _metadata(llmd, name, options)
    metadata["labels"] = with_role(metadata["labels"], pd_role)
    if canary:
        metadata["labels"].update({contracts.TRACK_LABEL: contracts.CANARY_TRACK,
                                   contracts.REVISION_LABEL: spec_hash(llmd)})  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": "ClusterIP",
            "selector": with_role(serving_labels(llmd, canary), pd_role),
            "ports": [
                {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                for name, port in contracts.serving_ports(llmd.spec)
            ],
        },
    }


def wants_disruption_budget(llmd: api.LLMDeployment, prefill: bool = False) -> bool:
    """A PDB only makes sense when the role can have more than one replica."""
    role = llmd.spec.prefill if prefill else llmd.spec
    assert role is not None
    autoscaling = role.autoscaling
    most = autoscaling.max_replicas if autoscaling and autoscaling.enabled else 0
    return max(most, role.replicas) > 1


def disruption_budget(
    llmd: api.LLMDeployment, options: Options = Options(), prefill: bool = False
) -> dict[str, Any]:
    """At most one engine pod of the role evicted at a time (`prefill`: the prefill role's)."""
    pd_role = contracts.PREFILL_ROLE if prefill else decode_role(llmd)
    metadata = _metadata(llmd, prefill_name(llmd) if prefill else engine_name(llmd), options)
    metadata["labels"] = with_role(metadata["labels"], pd_role)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": with_role(selector_labels(llmd), pd_role)},
            # A crash-looping pod must not block node drains.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _label_key(label: str) -> str:
    """A pod label as Prometheus' Kubernetes discovery names it (non-alphanumerics -> _)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def pod_monitor(llmd: api.LLMDeployment, options: Options = Options()) -> dict[str, Any]:
    return {
        "apiVersion": PODMONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": _metadata(llmd, engine_name(llmd), options),
        "spec": {
            "selector": {"matchLabels": serving_labels(llmd)},
            "podMetricsEndpoints": [
                {
                    "port": port_name,
                    "path": METRICS_PATH,
                    "interval": "15s",
                    # The chart's alerts and dashboard select engines by job and deployment.
                    "relabelings": [
                        {
                            "action": "replace",
                            "targetLabel": "job",
                            "replacement": "kubellm-engine",
                        },
                        {
                            "action": "replace",
                            "sourceLabels": [
                                f"__meta_kubernetes_pod_label_{_label_key(DEPLOYMENT_LABEL)}"
                            ],
                            "targetLabel": "deployment",
                        },
                    ],
                }
                for port_name, _ in contracts.serving_ports(llmd.spec)
            ],
        },
    }


# --------------------------------------------------------------------------- Inference Extension

INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
HTTPROUTE_API_VERSION = "gateway.networking.k8s.io/v1"
MODEL_NAME_HEADER = "X-Gateway-Model-Name"  # set by the Inference Extension's body-based router


RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"
PICKER_CONTAINER = "epp"
PICKER_USER = 65532  # the kubellm image's non-root user, as the chart runs it
# What a pool's own picker may read, in its namespace only: the LLMDeployments (routing,
# fallback and SLO settings) and the engines' EndpointSlices. No Secret: overflow goes
# through the fallback forwarder, which holds the API keys.
PICKER_RULES: tuple[dict[str, Any], ...] = (
    {"apiGroups": [api.GROUP], "resources": [api.PLURAL], "verbs": ["list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
     "verbs": ["list", "watch"]},
)  # fmt: skip


# Where the picker reads the tenants file of spec.routing.inferencePool.endpointPicker
# .tenantsSecretRef (a Secret of the pool's own namespace: pods mount no other namespace's)
TENANTS_DIR = "/etc/kubellm/tenants"
TENANTS_FILE = "tenants.yaml"
TENANTS_CHECKSUM_ANNOTATION = "checksum/tenants"  # as the chart's pods carry it


def picker_name(llmd: api.LLMDeployment) -> str:
    return contracts.endpoint_picker_name(llmd.metadata.name)


def runs_own_picker(llmd: api.LLMDeployment, options: Options = Options()) -> bool:
    """Whether the operator runs this pool's picker: a pool is wanted, the spec names no
    picker Service and the operator was told of no shared one."""
    wanted = llmd.spec.routing.inference_pool
    return (
        wanted is not None and wanted.endpoint_picker.name is None and options.picker.shared is None
    )


def picker_service_name(llmd: api.LLMDeployment, options: Options = Options()) -> str:
    """The Service the pool's endpointPickerRef names: the spec's, else the shared one the
    operator was told of, else the pool's own (`N-epp`)."""
    wanted = llmd.spec.routing.inference_pool
    assert wanted is not None
    return wanted.endpoint_picker.name or options.picker.shared or picker_name(llmd)


def picker_selector(llmd: api.LLMDeployment) -> dict[str, str]:
    """The pool's own picker pods: not the engine selector (nor the deployment label, so no
    engine Service, PDB or pod check ever counts them)."""
    return {
        "app.kubernetes.io/name": "kubellm-epp",
        "app.kubernetes.io/instance": llmd.metadata.name,
    }


def _picker_metadata(llmd: api.LLMDeployment, options: Options) -> dict[str, Any]:
    meta = _metadata(llmd, picker_name(llmd), options)
    # The deployment label stays (the operator's watch maps a child to its owner by it); a
    # picker Service's EndpointSlices carry it but have no `http` port, so no component
    # reads them as engines.
    meta["labels"].update({**picker_selector(llmd), "app.kubernetes.io/component": "epp"})
    return meta


def _picker_ports(port: int) -> tuple[int, int]:
    """The picker's gRPC health and metrics ports, clear of its ext_proc port."""
    health = 9003 if port != 9003 else 9004
    metrics = 9090 if port != 9090 else 9091
    return health, metrics


def picker_command(llmd: api.LLMDeployment, options: Options = Options()) -> list[str]:
    """`kubellm epp` for this pool alone, reading this namespace alone."""
    wanted = llmd.spec.routing.inference_pool
    assert wanted is not None
    port = wanted.endpoint_picker.port
    health, metrics = _picker_ports(port)
    ns = llmd.metadata.namespace
    command = [
        "kubellm", "epp", "--host=0.0.0.0", f"--grpc-port={port}",
        f"--grpc-health-port={health}", f"--metrics-port={metrics}", f"--namespace={ns}",
        f"--pool-name={engine_name(llmd)}", f"--pool-namespace={ns}",
    ]  # fmt: skip
    if options.picker.fallback_forwarder:
        command.append(f"--fallback-forwarder={options.picker.fallback_forwarder}")
    if wanted.endpoint_picker.tenants_secret_ref is not None:
        command.append(f"--tenants={TENANTS_DIR}/{TENANTS_FILE}")
        if options.picker.quota_redis:
            command.append(f"--quota-redis={options.picker.quota_redis}")
    return command


def picker_service_account(llmd: api.LLMDeployment, options: Options = Options()) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _picker_metadata(llmd, options),
    }


def picker_role(llmd: api.LLMDeployment, options: Options = Options()) -> dict[str, Any]:
    """What the pool's picker reads, in this namespace only. The operator holds these
    permissions itself (Kubernetes lets no one grant what it does not hold)."""
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "Role",
        "metadata": _picker_metadata(llmd, options),
        "rules": [dict(rule) for rule in PICKER_RULES],
    }


def picker_role_binding(llmd: api.LLMDeployment, options: Options = Options()) -> dict[str, Any]:
    name = picker_name(llmd)
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "RoleBinding",
        "metadata": _picker_metadata(llmd, options),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [
            {"kind": "ServiceAccount", "name": name, "namespace": llmd.metadata.namespace}
        ],
    }


def picker_deployment(llmd: api.LLMDeployment, options: Options = Options()) -> dict[str, Any]:
    """The pool's own picker: `kubellm epp --pool-name N-engine`, restricted pods."""
    wanted = llmd.spec.routing.inference_pool
    assert wanted is not None
    port = wanted.endpoint_picker.port
    health, metrics = _picker_ports(port)

    def grpc_probe(service: str, period: int, timeout: int, failures: int) -> dict[str, Any]:
        return {"grpc": {"port": health, "service": service}, "periodSeconds": period,
                "timeoutSeconds": timeout, "failureThreshold": failures}  # fmt: skip

    container: dict[str, Any] = {
        "name": PICKER_CONTAINER,
        "image": options.picker.image,
        "imagePullPolicy": options.picker.image_pull_policy,
        "command": picker_command(llmd, options),
        "ports": [
            {"name": "grpc", "containerPort": port, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": health, "protocol": "TCP"},
            {"name": "metrics", "containerPort": metrics, "protocol": "TCP"},
        ],
        "env": [
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            }
        ],
        "readinessProbe": grpc_probe("readiness", 5, 3, 2),
        "livenessProbe": grpc_probe("liveness", 20, 5, 3),
        "resources": {k: dict(v) for k, v in options.picker.resources.items()},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": TMP_DIR}],
    }
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(metrics),
        "prometheus.io/path": METRICS_PATH,
    }
    tenants = wanted.endpoint_picker.tenants_secret_ref
    if tenants is not None:  # the tenants file, from a Secret of this namespace
        volumes.append({
            "name": "tenants",
            "secret": {"secretName": tenants.name,
                       "items": [{"key": tenants.key, "path": TENANTS_FILE}]},
        })  # fmt: skip
        container["volumeMounts"].append(
            {"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True}
        )
        if options.tenants_checksum:
            annotations[TENANTS_CHECKSUM_ANNOTATION] = options.tenants_checksum
    metadata = _picker_metadata(llmd, options)
    pod_labels = {**metadata["labels"]}
    pod_labels.pop(DEPLOYMENT_LABEL)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": wanted.endpoint_picker.replicas,
            "selector": {"matchLabels": picker_selector(llmd)},
            # A new picker is ready before an old one goes: under FailClose no gap.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": pod_labels, "annotations": annotations},
                "spec": {
                    "serviceAccountName": picker_name(llmd),
                    "automountServiceAccountToken": True,  # it watches the API
                    "enableServiceLinks": False,
                    "containers": [container],
                    "volumes": volumes,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": PICKER_USER,
                        "runAsGroup": PICKER_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                },
            },
        },
    }


def picker_service(llmd: api.LLMDeployment, options: Options = Options()) -> dict[str, Any]:
    """The Service the pool's endpointPickerRef names (its port: the ext_proc gRPC port)."""
    wanted = llmd.spec.routing.inference_pool
    assert wanted is not None
    port = wanted.endpoint_picker.port
    health, metrics = _picker_ports(port)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _picker_metadata(llmd, options),
        "spec": {
            "type": "ClusterIP",
            "selector": picker_selector(llmd),
            "ports": [
                {
                    "name": "grpc",
                    "port": port,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "http2",
                },
                {
                    "name": "grpc-health",
                    "port": health,
                    "targetPort": "grpc-health",
                    "protocol": "TCP",
                    "appProtocol": "http2",
                },
                {"name": "metrics", "port": metrics, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def build_picker(llmd: api.LLMDeployment, options: Options = Options()) -> list[dict[str, Any]]:
    """The pool's own picker and what lets it read its namespace, in apply order (the
    account and its grant before the pods that use them)."""
    return [
        picker_service_account(llmd, options),
        picker_role(llmd, options),
        picker_role_binding(llmd, options),
        picker_deployment(llmd, options),
        picker_service(llmd, options),
    ]


def inference_pool(llmd: api.LLMDeployment, options: Options = Options()) -> dict[str, Any]:
    """The InferencePool of the engine pods, with kubellm's EPP as its endpoint picker.
    Its status belongs to the Gateway controllers; the operator writes only the spec."""
    wanted = llmd.spec.routing.inference_pool
    assert wanted is not None
    picker = wanted.endpoint_picker
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": _metadata(llmd, engine_name(llmd), options),
        "spec": {
            "selector": {"matchLabels": serving_labels(llmd)},
            "targetPorts": [{"number": port} for _, port in contracts.serving_ports(llmd.spec)],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker_service_name(llmd, options),
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }


def gateway_duration(seconds: float) -> str:
    """`seconds` as a Gateway API Duration (GEP-2257, `^([0-9]{1,5}(h|m|s|ms)){1,4}$`),
    to the millisecond, rounded up: 600 -> "10m", 2.5 -> "2s500ms", 86400 -> "24h"."""
    ms = max(1, math.ceil(seconds * 1000 - 1e-6))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    parts = ((hours, "h"), (minutes, "m"), (secs, "s"), (ms, "ms"))
    return "".join(f"{value}{unit}" for value, unit in parts if value)


def route_timeouts(llmd: api.LLMDeployment) -> dict[str, str]:
    """The HTTPRoute rule's `timeouts`: `request` is the whole request's bound the kubellm
    gateway applies (spec.routing.timeouts.totalSeconds, else its 600 s default), so a
    frozen picker or replica cannot hold a client longer through the Gateway than through
    the gateway. No `backendRequest`: it covers a whole backend answer too, and the route
    sets no retries, so anything shorter than `request` would cut long streams."""
    total = llmd.spec.routing.timeouts.total_seconds or contracts.DEFAULT_TOTAL_SECONDS
    return {"request": gateway_duration(total)}


def http_route(llmd: api.LLMDeployment, options: Options = Options()) -> dict[str, Any]:
    """An HTTPRoute from the spec's Gateways to the InferencePool."""
    wanted = llmd.spec.routing.inference_pool
    assert wanted is not None
    parents = []
    for ref in wanted.parent_refs:
        parent: dict[str, Any] = {
            "group": "gateway.networking.k8s.io", "kind": "Gateway", "name": ref.name,
        }  # fmt: skip
        if ref.namespace:
            parent["namespace"] = ref.namespace
        if ref.section_name:
            parent["sectionName"] = ref.section_name
        parents.append(parent)
    match: dict[str, Any] = {"path": {"type": "PathPrefix", "value": "/"}}
    pool = f"{llmd.metadata.namespace or 'default'}/{engine_name(llmd)}"
    if wanted.match_model_header:
        match["headers"] = [{"type": "Exact", "name": MODEL_NAME_HEADER, "value": llmd.served_name}]
    return {
        "apiVersion": HTTPROUTE_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": _metadata(llmd, engine_name(llmd), options),
        "spec": {
            "parentRefs": parents,
            "rules": [
                {
                    "matches": [match],
                    "backendRefs": [
                        {
                            "group": "inference.networking.k8s.io",
                            "kind": "InferencePool",
                            "name": engine_name(llmd),
                        }
                    ],
                    "timeouts": route_timeouts(llmd),
                    # the pool this route sends to, for a picker serving several: set here,
                    # in place of any value a client sent (contracts.POOL_HEADER)
                    "filters": [
                        {
                            "type": "RequestHeaderModifier",
                            "requestHeaderModifier": {
                                "set": [{"name": contracts.POOL_HEADER, "value": pool}]
                            },
                        }
                    ],
                }
            ],
        },
    }


# --------------------------------------------------------------------------- all children


# Every kind of child the operator may create: (apiVersion, kind).
CHILD_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ConfigMap"),
    ("apps/v1", "Deployment"),
    (LWS_API_VERSION, LWS_KIND),
    ("v1", "Service"),
    ("policy/v1", "PodDisruptionBudget"),
    (PODMONITOR_API_VERSION, "PodMonitor"),
    (INFERENCE_POOL_API_VERSION, "InferencePool"),
    (HTTPROUTE_API_VERSION, "HTTPRoute"),
)
# The kinds of a pool's own picker (named `N-epp`; its Deployment and Service beside the
# engine's).
PICKER_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ServiceAccount"),
    (RBAC_API_VERSION, "Role"),
    (RBAC_API_VERSION, "RoleBinding"),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
)


# The prefill role's children (spec.prefill): read where they may exist, so that removing
# spec.prefill deletes them.
PREFILL_KINDS: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("policy/v1", "PodDisruptionBudget"),
)
PREFILL_CANARY_KINDS: tuple[tuple[str, str], ...] = (("apps/v1", "Deployment"), ("v1", "Service"))


def child_name(llmd: api.LLMDeployment, kind: str) -> str:
    if kind == LWS_KIND:
        return lws_name(llmd)
    return spec_configmap_name(llmd) if kind == "ConfigMap" else engine_name(llmd)


# The canary revision's children (spec.rollout.strategy Canary, while a rollout runs).
CANARY_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ConfigMap"),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
)


def canary_child_name(llmd: api.LLMDeployment, kind: str) -> str:
    if kind == LWS_KIND:
        return lws_name(llmd, canary=True)
    return spec_configmap_name(llmd, canary=True) if kind == "ConfigMap" else canary_name(llmd)


def canary_kinds(llmd: api.LLMDeployment) -> tuple[tuple[str, str], ...]:
    """CANARY_KINDS with the engine workload of this spec's shape second."""
    return tuple((workload_kind(llmd) if kind == "Deployment" else (v, kind))
                 for v, kind in CANARY_KINDS)  # fmt: skip


def build_canary(
    llmd: api.LLMDeployment,
    replicas: int,
    options: Options = Options(),
    prefill_replicas_canary: int | None = None,
) -> list[dict[str, Any]]:
    """The canary revision of `llmd` (its spec, as the stable one will be once promoted):
    its engine-spec ConfigMap, a Deployment of `replicas` and a Service, labelled with the
    revision and the canary track; with spec.prefill, the prefill role's Deployment (of
    `prefill_replicas_canary`) and Service `N-prefill-canary` too."""
    objects = [
        spec_configmap(llmd, options, canary=True),
        engine_workload(llmd, options, replicas=replicas, canary=True),
        engine_service(llmd, options, canary=True),
    ]
    if prefill_replicas_canary is not None and split(llmd):
        objects += [
            engine_deployment(llmd, options, replicas=prefill_replicas_canary, canary=True,
                              prefill=True),
            engine_service(llmd, options, canary=True, prefill=True),
        ]  # fmt: skip
    return objects


def build(llmd: api.LLMDeployment, options: Options = Options()) -> list[dict[str, Any]]:
    """Every object the operator wants for `llmd`, in apply order; raise SpecError."""
    check(llmd, options)
    objects = [
        spec_configmap(llmd, options),
        engine_workload(llmd, options),
        engine_service(llmd, options),
    ]
    if wants_disruption_budget(llmd):
        objects.append(disruption_budget(llmd, options))
    if split(llmd):
        objects += [engine_deployment(llmd, options, prefill=True),
                    engine_service(llmd, options, prefill=True)]  # fmt: skip
        if wants_disruption_budget(llmd, prefill=True):
            objects.append(disruption_budget(llmd, options, prefill=True))
    if options.podmonitor:
        objects.append(pod_monitor(llmd, options))
    wanted = llmd.spec.routing.inference_pool
    if wanted is not None and options.inference_pool:
        if runs_own_picker(llmd, options):
            objects += build_picker(llmd, options)
        objects.append(inference_pool(llmd, options))
        if wanted.parent_refs and options.http_route:
            objects.append(http_route(llmd, options))
    return objects
