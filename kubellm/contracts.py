"""What the components agree on about engines, beyond the API models and metric names.

Each contract lives here once; the operator writes it, the gateway, the
autoscaler and the local fleet read it:

- labels: every child of an LLMDeployment N carries `kubellm.io/deployment=N`
  (`DEPLOYMENT_LABEL`), and the Service passes it to its EndpointSlices, which is
  how the gateway and the autoscaler find N's engines;
- the engine port is named `http` (`PORT_NAME`) on the pod, the Service and the
  EndpointSlices;
- `slice_endpoints` reads an EndpointSlice into one record per engine, with the
  endpoint conditions as Kubernetes defines them (each component then applies its
  own rule: the gateway routes to ready ones and lets terminating ones finish, the
  autoscaler counts ready ones);
- `engine_spec_document` / `engine_spec_json`: the LLMDeployment as the engine
  reads it from `sources.SPEC_PATH` (the operator mounts it, the local fleet writes
  it to a file; vLLM's launcher and the simulator read it);
- `max_loras` / `engine_identity_json`: LoRA is on when `spec.engine.maxLoras` is set or
  `spec.adapters` lists any; the adapters themselves are in the engine spec (new replicas
  start with them) but not in its identity, so adding or removing one restarts nothing
  (running replicas load adapters at runtime, see docs/architecture.md);
- `fallback_target` turns `spec.fallback` into the settings of the overflow API
  the gateway calls (`FallbackTarget`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubellm import api

DEPLOYMENT_LABEL = "kubellm.io/deployment"
PORT_NAME = "http"
# A canary rollout (spec.rollout.strategy Canary): the canary revision's Deployment, pods and
# Service carry the revision and the track; the Service's EndpointSlices copy both, which is
# how the gateway tells a canary endpoint from a stable one (unlabelled: stable).
REVISION_LABEL = "kubellm.io/revision"
TRACK_LABEL = "kubellm.io/track"
CANARY_TRACK = "canary"
# Prefill/decode disaggregation (spec.prefill): the prefill role's Deployment, pods, Service and
# PDB carry ROLE_LABEL=prefill, the decode role's (the rest of the spec) ROLE_LABEL=decode; the
# Services' EndpointSlices copy it, which is how the gateway tells the roles apart. Unlabelled
# engines serve both phases (aggregated).
ROLE_LABEL = "kubellm.io/role"
PREFILL_ROLE = "prefill"
DECODE_ROLE = "decode"
# `kubellm rollout abort|promote NAME` sets it; the operator acts once and removes it.
ROLLOUT_ACTION_ANNOTATION = "kubellm.io/rollout-action"
ROLLOUT_ACTIONS = ("abort", "promote")


# --------------------------------------------------------------------------- labels


def selector_labels(name: str) -> dict[str, str]:
    """The immutable pod selector of deployment `name`'s engines (Deployment, Service, PDB)."""
    return {
        "app.kubernetes.io/name": "kubellm-engine",
        "app.kubernetes.io/instance": name,
        DEPLOYMENT_LABEL: name,
    }


def inference_pool_name(deployment: str) -> str:
    """The InferencePool the operator creates for LLMDeployment `deployment` (its engine
    name, in the same namespace): the pool an endpoint picker started with `--pool-name`
    serves, as the Inference Extension's picker serves one pool."""
    return f"{deployment}-engine"


# The request header naming the InferencePool a request's route sends it to, set by that
# route (the operator's HTTPRoute, the standalone Envoy's listener), never by a client:
# `<namespace>/<pool>` or `<pool>`. An endpoint picker picks only within that pool.
POOL_HEADER = "x-kubellm-inference-pool"


def endpoint_picker_name(deployment: str) -> str:
    """The endpoint picker the operator runs for LLMDeployment `deployment`'s InferencePool
    (Deployment, Service, ServiceAccount, Role and RoleBinding, in the same namespace)."""
    return f"{deployment}-epp"


# The whole request's bound when spec.routing.timeouts.totalSeconds is unset: the kubellm
# gateway's --total-timeout default, and the `timeouts.request` of the operator's HTTPRoute.
DEFAULT_TOTAL_SECONDS = 600.0


def engine_labels(name: str) -> dict[str, str]:
    """Labels on every child of deployment `name`; the Service's reach its EndpointSlices."""
    return {
        **selector_labels(name),
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": "kubellm-operator",
        "app.kubernetes.io/part-of": "kubellm",
    }


# --------------------------------------------------------------------------- data-parallel ranks

# With spec.engine.dataParallelSize > 1, each data-parallel rank whose GPUs lie inside one pod
# runs an API server of its own (vLLM's external load balancing): the pod's first local rank
# on the port named `http`, its others on `http-dp<i>` (spec.engine.port + i). Each rank is
# then an endpoint of its own for the gateway, so prefix routing reaches the rank holding the
# blocks; the autoscaler folds a replica's ranks back into one replica (`replica_key`).
RANK_PORT_PREFIX = "http-dp"
# The Gateway API Inference Extension's InferencePool lists at most 8 target ports.
MAX_RANK_PORTS = 8


def dp_ranks_per_pod(spec: api.LLMDeploymentSpec) -> int:
    """Data-parallel ranks one engine pod serves as endpoints of their own: 0 with one rank
    (dataParallelSize 1), on a CPU engine, or when a rank's GPUs (TP x PP) do not fit whole
    inside a pod (the ranks then stay behind the leader's internal balancer, one endpoint)."""
    engine, gpus = spec.engine, spec.resources.gpu.count
    per_rank = engine.tensor_parallel_size * engine.pipeline_parallel_size
    if engine.data_parallel_size == 1 or gpus == 0 or gpus % per_rank:
        return 0
    return min(gpus // per_rank, engine.data_parallel_size)


def serving_ports(spec: api.LLMDeploymentSpec) -> list[tuple[str, int]]:
    """(name, port) of each API server of one serving engine pod: `http` on
    spec.engine.port, then `http-dp<i>` on port + i for the pod's other local ranks."""
    port = spec.engine.port
    ranks = range(1, dp_ranks_per_pod(spec))
    return [(PORT_NAME, port), *((f"{RANK_PORT_PREFIX}{i}", port + i) for i in ranks)]


def is_serving_port(name: object) -> bool:
    """An engine API port's name: `http`, or a data-parallel rank's `http-dp<i>`."""
    if not isinstance(name, str):
        return False
    rank = name.removeprefix(RANK_PORT_PREFIX)
    return name == PORT_NAME or (rank != name and rank.isdigit() and rank[0] != "0")


def replica_key(pod: str) -> str:
    """The replica an engine pod belongs to: the pod itself, or for a LeaderWorkerSet's pod
    (`<lws>-<group>` the leader, `<lws>-<group>-<worker>` a worker, LWS's naming) its group,
    named by the leader."""
    head, _, tail = pod.rpartition("-")
    stem, _, group = head.rpartition("-")
    if tail.isdigit() and group.isdigit() and stem.endswith("-lws"):
        return head
    return pod


# --------------------------------------------------------------------------- EndpointSlices


@dataclass(frozen=True)
class SliceEndpoint:
    """One engine of an EndpointSlice: where it listens and its conditions. A pod serving
    several data-parallel ranks is one SliceEndpoint per rank (per port)."""

    name: str  # the pod (targetRef), else the address
    url: str  # http://host:port, no path
    ready: bool
    serving: bool
    terminating: bool

    @property
    def replica(self) -> str:
        """The replica (pod, or LeaderWorkerSet group) this endpoint is a part of."""
        return replica_key(self.name)

    @property
    def routable(self) -> bool:
        """May take new requests: ready and not on its way out."""
        return self.ready and not self.terminating

    @property
    def draining(self) -> bool:
        """On its way out but still serving: finishes what it has, takes nothing new."""
        return self.serving and self.terminating


def slice_endpoints(slice_: Mapping[str, Any]) -> list[SliceEndpoint]:
    """The engines of one EndpointSlice on its port named `http` and its data-parallel
    ranks' `http-dp<i>` ports, one per address and port (none without an `http` port).

    Conditions as Kubernetes defines them: an absent `ready` means ready, an absent
    `serving` means what `ready` says, an absent `terminating` means not terminating.
    Only an endpoint's first address is used (the others are the same pod)."""
    named = {p.get("name"): p.get("port") for p in slice_.get("ports") or []}
    ports = sorted((n, p) for n, p in named.items() if is_serving_port(n) and isinstance(p, int))[
        :MAX_RANK_PORTS
    ]
    if PORT_NAME not in named:
        return []
    out = []
    for item in slice_.get("endpoints") or []:
        addresses = item.get("addresses") or []
        if not addresses:
            continue
        host = f"[{addresses[0]}]" if ":" in addresses[0] else addresses[0]
        conditions = item.get("conditions") or {}
        ready = conditions.get("ready") is not False
        for _, port in ports:
            out.append(
                SliceEndpoint(
                    name=(item.get("targetRef") or {}).get("name") or addresses[0],
                    url=f"http://{host}:{port}",
                    ready=ready,
                    serving=conditions.get("serving", ready) is not False,
                    terminating=conditions.get("terminating") is True,
                )
            )
    return out


# --------------------------------------------------------------------------- the engine spec


def engine_spec_document(llmd: api.LLMDeployment) -> dict[str, Any]:
    """The LLMDeployment as the engine launcher reads it from SPEC_PATH.

    Only what shapes the engine process (model, engine, resources, adapters) is kept, so
    that scaling (`spec.replicas`), routing, fallback or SLO edits do not change
    the spec hash and so never restart GPU pods. Omitted fields take their
    defaults, so the document is itself a valid LLMDeployment. The one routing setting an
    engine needs is kept when it is on: `prefixIndex: precise` with its `kvEventsPort`
    (the launcher turns vLLM's KV-cache events on, which needs a restart); approximate
    specs keep the document, and so the pods, they had.
    """
    spec = llmd.spec
    dump: dict[str, Any] = {"by_alias": True, "exclude_none": True, "mode": "json"}
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": llmd.metadata.name, "namespace": llmd.metadata.namespace},
        "spec": {
            "model": spec.model.model_dump(**dump),
            "engine": spec.engine.model_dump(**dump),
            "resources": spec.resources.model_dump(**dump),
            **(
                {"adapters": [a.model_dump(**dump) for a in spec.adapters]} if spec.adapters else {}
            ),
            **({"prefill": _prefill_engine(spec.prefill)} if spec.prefill else {}),
            **(
                {
                    "routing": {
                        "prefixIndex": "precise",
                        "kvEventsPort": spec.routing.kv_events_port,
                    }
                }
                if spec.routing.prefix_index == "precise"
                else {}
            ),
        },
    }


def _prefill_engine(prefill: api.Prefill) -> dict[str, Any]:
    """What of spec.prefill shapes an engine process (either role's: the decode role is
    the connector's consumer): its engine overrides, resources and KV connector; not its
    replicas, split rule or autoscaling, so that scaling the prefill role restarts nothing."""
    dump: dict[str, Any] = {"by_alias": True, "exclude_none": True, "mode": "json"}
    return prefill.model_dump(include={"engine", "resources", "kv_connector"}, **dump)


def engine_spec_json(llmd: api.LLMDeployment) -> str:
    """`engine_spec_document` as the file's text (stable: sorted keys)."""
    return json.dumps(engine_spec_document(llmd), sort_keys=True, indent=2) + "\n"


# Adapter slots of one engine step when spec.adapters lists adapters but
# spec.engine.maxLoras is unset (vLLM's own default, 1, serialises any two adapters).
DEFAULT_MAX_LORAS = 4


def max_loras(spec: api.LLMDeploymentSpec) -> int | None:
    """The engine's LoRA slots, or None when LoRA is off (no maxLoras, no adapters)."""
    if spec.engine.max_loras is not None:
        return spec.engine.max_loras
    return DEFAULT_MAX_LORAS if spec.adapters else None


def engine_identity_json(llmd: api.LLMDeployment) -> str:
    """What a running engine cannot change without a restart: the engine spec without the
    adapter list, LoRA's slot count made explicit. Its hash is the pod template's; the
    local fleet replaces replicas only when it changes."""
    document = engine_spec_document(llmd)
    document["spec"].pop("adapters", None)
    slots = max_loras(llmd.spec)
    if slots is not None:  # without LoRA the identity is the engine spec itself
        document["spec"]["engine"]["maxLoras"] = slots
    return json.dumps(document, sort_keys=True, indent=2) + "\n"


def revision(llmd: api.LLMDeployment) -> str:
    """The spec's revision: a short hash of its engine identity. A change to it restarts
    engines (Rolling) or starts a canary revision (Canary); nothing else does."""
    return hashlib.sha256(engine_identity_json(llmd).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- the fallback API


@dataclass(frozen=True)
class FallbackTarget:
    """An external OpenAI-compatible API that takes overflow. The key is never printed."""

    url: str
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    max_concurrency: int = 64
    triggers: tuple[str, ...] = ("saturated", "no-ready-replicas")


class FallbackSettings(Protocol):
    """What `fallback_target` reads: `api.Fallback`, or a static file's equivalent."""

    @property
    def url(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def max_concurrency(self) -> int: ...
    @property
    def triggers(self) -> Sequence[str]: ...


def fallback_target(
    settings: FallbackSettings | None, api_key: str | None = None
) -> FallbackTarget | None:
    """The overflow API of a deployment, or None when it has no fallback URL.

    The URL loses any trailing `/` (the gateway appends `/chat/completions` etc.)."""
    if settings is None or not settings.url:
        return None
    return FallbackTarget(
        url=settings.url.rstrip("/"),
        model=settings.model,
        api_key=api_key,
        max_concurrency=settings.max_concurrency,
        triggers=tuple(settings.triggers),
    )


def registered_adapters(models: object, base: str | None = None) -> set[str] | None:
    """The adapters a replica's `/v1/models` answer lists (cards with a parent); None when
    the answer is not vLLM's shape."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        return None
    out = set()
    for card in models["data"]:
        if (
            isinstance(card, dict)
            and isinstance(card.get("id"), str)
            and card.get("parent")
            and (base is None or card["parent"] == base)
        ):
            out.add(card["id"])
    return out
