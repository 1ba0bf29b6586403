"""The discovery interface and the values it yields.

A `ModelTarget` is everything the gateway needs to serve one model: the
engines (with their draining state), and the `routing`, `fallback` and `slo`
settings that an `LLMDeployment` carries (the same pydantic models). A source
hands out immutable snapshots, so a request routes against one consistent view.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Protocol

from kubellm.api import SLO, LLMDeploymentSpec, Routing
from kubellm.capacity import KV_LINK_GBPS, kv_bytes_per_token, kv_link_gbps
from kubellm.contracts import (
    PREFILL_ROLE,
    FallbackTarget,  # the core builds it from a spec: fallback_target
    inference_pool_name,
)

__all__ = [
    "AdapterRef",
    "CanarySplit",
    "Discovery",
    "Endpoint",
    "FallbackTarget",
    "FixedDiscovery",
    "ModelTarget",
    "PoolDiscovery",
    "PrefillSplit",
    "StepCosts",
    "find_model",
    "prefill_split",
]


@dataclass(frozen=True)
class StepCosts:
    """An engine's step costs, as the slo-aware latency model takes its prior
    (routing/latency/model.py `Prior`): a step's fixed part, each prompt token's, each decoding
    sequence's, and the prompt tokens one step computes at most. Known exactly for a
    simulated replica (its profile); discovery carries the figures, routing builds the prior."""

    step_base_s: float
    prefill_token_s: float
    decode_token_s: float
    max_num_batched_tokens: int


@dataclass(frozen=True)
class Endpoint:
    """One engine: its base URL (no `/v1`), whether it is draining (no new requests), and,
    where it is not the model's spec.routing.kvEventsPort (replicas of a local fleet share
    one host), the port it publishes KV-cache events on."""

    url: str
    draining: bool = False
    kv_events_port: int | None = None
    # The canary revision it runs during a canary rollout (its EndpointSlice's
    # kubellm.io/revision label); None: the stable revision.
    revision: str | None = None
    # Its step costs where discovery knows them (a local simulated replica: its profile);
    # None: the model's prior (ModelTarget.decode_tokens_per_second_bound) or the default.
    step_costs: StepCosts | None = None
    # Its role (contracts.ROLE_LABEL: "prefill" or "decode"); None: it serves both phases.
    role: str | None = None


@dataclass(frozen=True)
class PrefillSplit:
    """A model with a prefill role (spec.prefill): when a request is split
    (routing/disagg.py), and what moving its KV cache costs."""

    split: Literal["Conditional", "Always"] = "Conditional"
    kv_bytes_per_token: int = 131_072  # Llama 3.1 8B in bf16
    link_bytes_per_s: float = KV_LINK_GBPS["rdma"] * 1e9
    # Conditional splits when the split's predicted SLO cost is under the local one's by
    # this share. 0: swept against the latency model's error (bench/simulation/pd_disagg.py
    # --sweep; docs/operations.md, "Prefill/decode disaggregation"), any margin lost goodput
    # on every workload: the error is both ways, and a long prompt kept local by mistake
    # stalls every stream there, which costs more than a needless split.
    margin: float = 0.0


def prefill_split(spec: LLMDeploymentSpec) -> PrefillSplit | None:
    """The split settings of a spec with a prefill role (None: aggregated)."""
    prefill = spec.prefill
    if prefill is None:
        return None
    connector = prefill.kv_connector
    gbps = kv_link_gbps(connector)
    arch = spec.model.architecture
    kv_bytes = 1 if spec.engine.kv_cache_dtype.startswith("fp8") else 2
    per_token = (
        kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, kv_bytes)
        if arch is not None
        else PrefillSplit.kv_bytes_per_token
    )
    return PrefillSplit(prefill.split, per_token, gbps * 1e9)


@dataclass(frozen=True)
class CanarySplit:
    """A canary step's split (status.rollout while it is Progressing or RolledBack): the
    canary revision and the percent of requests it takes (routing/canary/revisions.py)."""

    revision: str
    weight: int
    # The shadow step (status.rollout.shadow): the share of stable requests mirrored to the
    # canary and the mirrored requests one gateway keeps in flight (routing/canary/mirror.py).
    shadow_share: float = 0.0
    shadow_concurrency: int = 0
    shadow_tokens: int = 16  # k: the first tokens whose agreement is counted


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter of a model (spec.adapters): its name, and the path (or Hugging Face
    id) a replica loads it from (`kubellm.sources.adapter_path`)."""

    name: str
    path: str


@dataclass(frozen=True)
class ModelTarget:
    served_name: str
    deployment: str
    namespace: str = "default"
    endpoints: tuple[Endpoint, ...] = ()
    routing: Routing = field(default_factory=Routing)
    fallback: FallbackTarget | None = None
    slo: SLO = field(default_factory=SLO)
    adapters: tuple[AdapterRef, ...] = ()
    # spec.model.source ("" when discovery does not know it): precise routing loads an
    # hf:// model's tokenizer from the same repository and revision when no --tokenizer
    # names one (routing/index/precise_routing.py)
    model_source: str = ""
    # While a canary rollout splits traffic: the canary revision and its weight.
    canary: CanarySplit | None = None
    # The InferencePool of the model's engines (None: the operator's name for it,
    # `<deployment>-engine`); an endpoint picker with --pool-name serves one pool only.
    pool: str | None = None
    # status.capacity.decodeTokensPerSecondBound (None: not known): the slo-aware latency
    # model's replicas of this model start from a prior scaled to it until they have answers.
    decode_tokens_per_second_bound: float | None = None
    # status.capacity (kvTokensGPU, kvTokensHost) of a replica with a host-memory KV tier
    # (spec.engine.kvOffload; None: no tier): the approximate prefix index models both
    kv_tier_tokens: tuple[int, int] | None = None
    # spec.prefill: requests may be split between the prefill and the decode role
    prefill: PrefillSplit | None = None

    @property
    def pool_name(self) -> str:
        return self.pool or inference_pool_name(self.deployment)

    def adapter(self, name: str) -> AdapterRef | None:
        return next((a for a in self.adapters if a.name == name), None)

    @cached_property
    def routable(self) -> tuple[Endpoint, ...]:
        """Endpoints that may take new requests (draining ones finish what they have): a
        whole request, so never a prefill replica. (Computed once: a target is an immutable
        snapshot, and every request reads it.)"""
        return tuple(e for e in self.endpoints if not e.draining and e.role != PREFILL_ROLE)

    @property
    def prefill_endpoints(self) -> tuple[Endpoint, ...]:
        """The prefill role's endpoints that may take a prefill leg."""
        return tuple(e for e in self.endpoints if not e.draining and e.role == PREFILL_ROLE)


def canary_split(rollout: Mapping[str, object] | None) -> CanarySplit | None:
    """The split an LLMDeployment's status.rollout asks for: the canary's weight while a step
    runs (Progressing), 0 once rolled back; None otherwise (no canary, or Promoting: the
    stable Deployment then rolls to the canary's revision and every endpoint serves)."""
    if not isinstance(rollout, Mapping):
        return None
    revision, phase, weight = (
        rollout.get("canaryRevision"), rollout.get("phase"), rollout.get("canaryWeight"),
    )  # fmt: skip
    if not isinstance(revision, str) or not revision:
        return None
    if phase == "RolledBack":
        return CanarySplit(revision, 0)
    if phase == "Progressing" and isinstance(weight, int) and not isinstance(weight, bool):
        share, concurrency, tokens = _shadow(rollout.get("shadow"))
        return CanarySplit(revision, max(0, min(100, weight)), share, concurrency, tokens)
    return None


def _shadow(shadow: object) -> tuple[float, int, int]:
    """(share, concurrency, k) of status.rollout.shadow; no mirror when absent or malformed."""
    off = (0.0, 0, 16)
    if not isinstance(shadow, Mapping):
        return off
    share, concurrency = shadow.get("share"), shadow.get("maxConcurrency")
    tokens = shadow.get("firstTokens", 16)
    if not isinstance(share, int | float) or isinstance(share, bool) or not 0 < share <= 1:
        return off
    for count in (concurrency, tokens):
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            return off
    return float(share), min(concurrency, 10_000), min(tokens, 256)


def find_model(
    snapshot: Mapping[str, ModelTarget], name: str
) -> tuple[ModelTarget, str | None] | None:
    """The model a request names: a served model (adapter None), or one of a model's LoRA
    adapters (that model, the adapter's name); None when nothing is called `name`."""
    target = snapshot.get(name)
    if target is not None:
        return target, None
    for target in snapshot.values():
        if target.adapter(name) is not None:
            return target, name
    return None


class Discovery(Protocol):
    """A source of models. `snapshot()` is cheap; `run()` keeps it current until cancelled."""

    def snapshot(self) -> Mapping[str, ModelTarget]: ...

    async def run(self, on_change: Callable[[], None]) -> None: ...


class FixedDiscovery:
    """A snapshot that changes only when told to: for tests and for embedding (local fleet)."""

    def __init__(self, models: Mapping[str, ModelTarget] | None = None) -> None:
        self._models: dict[str, ModelTarget] = dict(models or {})
        self._on_change: Callable[[], None] | None = None

    def snapshot(self) -> Mapping[str, ModelTarget]:
        return self._models

    def update(self, models: Mapping[str, ModelTarget]) -> None:
        self._models = dict(models)
        if self._on_change:
            self._on_change()

    async def run(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change
        await asyncio.Event().wait()


def model_cards(models: Mapping[str, ModelTarget]) -> dict[str, object]:
    """`GET /v1/models`'s answer: each model, then its LoRA adapters (with their parent)."""
    data: list[dict[str, object]] = []
    for name, target in sorted(models.items()):
        data.append({"id": name, "object": "model", "created": 0, "owned_by": "kubellm"})
        data += [
            {"id": a.name, "object": "model", "created": 0, "owned_by": "kubellm",
             "parent": name}
            for a in target.adapters
        ]  # fmt: skip
    return {"object": "list", "data": data}


def pool_cut(
    whole: Mapping[str, ModelTarget], name: str, namespace: str | None = None
) -> dict[str, ModelTarget]:
    """The models of InferencePool `name` (in `namespace` when given) among `whole`."""
    return {
        served: target
        for served, target in whole.items()
        if target.pool_name == name and (namespace is None or target.namespace == namespace)
    }


class PoolDiscovery:
    """Another source's models, cut to one InferencePool (`name`, in `namespace` when
    given): what an endpoint picker that serves one pool sees, as the Inference Extension's
    picker does. A request naming another pool's model is unknown here (404), and one that
    names no model goes to this pool's endpoints only: a pool is never crossed."""

    def __init__(self, inner: Discovery, name: str, namespace: str | None = None) -> None:
        self.inner = inner
        self.name = name
        self.namespace = namespace
        self._seen: Mapping[str, ModelTarget] | None = None
        self._cut: Mapping[str, ModelTarget] = {}

    def snapshot(self) -> Mapping[str, ModelTarget]:
        whole = self.inner.snapshot()
        if whole is not self._seen:  # snapshots are immutable: cut each one once
            self._cut = pool_cut(whole, self.name, self.namespace)
            self._seen = whole
        return self._cut

    async def run(self, on_change: Callable[[], None]) -> None:
        await self.inner.run(on_change)
