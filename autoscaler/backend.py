"""The loop's view of the world: what to scale, where its replicas are, how to write.

The control loop talks only to a `Backend`. `KubernetesBackend`
(`kubellm.autoscaler.kube_backend`) reads LLMDeployments and EndpointSlices
and writes /scale, status and Events through the API server; a local fleet
(no Kubernetes) implements the same nine methods over its own processes, and
the loop needs no special case for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kubellm import api


@dataclass(frozen=True)
class Target:
    """One deployment with autoscaling enabled, as read at the start of a period."""

    namespace: str
    name: str
    served_name: str
    replicas: int  # what /scale holds now (spec.replicas)
    autoscaling: api.Autoscaling
    status: dict[str, Any] = field(default_factory=dict)  # status.autoscaler, camelCase
    has_fallback: bool = False  # spec.fallback is set: the gateway sends overflow there
    fallback_max_concurrency: int | None = None  # spec.fallback.maxConcurrency
    # spec.autoscaling is on: the decode role (spec.replicas) is scaled; off, only the
    # prefill role is (its spec.prefill.autoscaling) and spec.replicas is read as it is
    scales_decode: bool = True
    prefill: api.PrefillAutoscaling | None = None  # spec.prefill.autoscaling when on
    prefill_replicas: int = 0  # spec.prefill.replicas now
    ttft_seconds: float = 2.0  # spec.slo.ttftSeconds: the prefill role's budget

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class AdapterTarget:
    """One deployment that lists LoRA adapters (or still shows them in status.adapters)."""

    namespace: str
    name: str
    served_name: str
    adapters: tuple[str, ...]  # spec.adapters names, in spec order
    status: list[dict[str, Any]] | None = None  # status.adapters as read, camelCase

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Endpoint:
    """One engine replica: where its Prometheus metrics are, and whether it is ready."""

    name: str
    metrics_url: str
    ready: bool

    @property
    def url(self) -> str:
        """The engine's base URL (its OpenAI API: /v1/models)."""
        return self.metrics_url.removesuffix("/metrics")


def target_for(
    deployment: api.LLMDeployment,
    status: dict[str, Any],
    replicas: int | None = None,
    prefill_replicas: int | None = None,
) -> Target | None:
    """The Target of a deployment whose decode or prefill autoscaling is on (None: neither);
    `replicas` / `prefill_replicas`: the counts now where they are not the spec's."""
    spec = deployment.spec
    decode = spec.autoscaling is not None and spec.autoscaling.enabled
    scaling = spec.prefill.autoscaling if spec.prefill is not None else None
    prefill = scaling if scaling is not None and scaling.enabled else None
    if not decode and prefill is None:
        return None
    fallback = spec.fallback
    return Target(
        namespace=deployment.metadata.namespace,
        name=deployment.metadata.name,
        served_name=deployment.served_name,
        replicas=spec.replicas if replicas is None else replicas,
        autoscaling=spec.autoscaling if decode else api.Autoscaling(),  # type: ignore[arg-type]
        status=status,
        has_fallback=fallback is not None and bool(fallback.url),
        fallback_max_concurrency=fallback.max_concurrency if fallback is not None else None,
        scales_decode=decode,
        prefill=prefill,
        prefill_replicas=(
            prefill_replicas if prefill_replicas is not None
            else spec.prefill.replicas if spec.prefill is not None else 0
        ),
        ttft_seconds=spec.slo.ttft_seconds,
    )  # fmt: skip


class Backend(Protocol):
    async def targets(self) -> list[Target]:
        """Deployments whose autoscaling is enabled."""
        ...

    async def adapter_targets(self) -> list[AdapterTarget]:
        """Deployments that list LoRA adapters, or whose status.adapters is still set."""
        ...

    async def endpoints(self, target: Target | AdapterTarget) -> list[Endpoint]:
        """The target's engine replicas, ready or not."""
        ...

    async def write_replicas(self, target: Target, replicas: int) -> None:
        """Set the desired replica count (the /scale subresource)."""
        ...

    async def prefill_endpoints(self, target: Target) -> list[Endpoint]:
        """The target's prefill role's engine replicas (spec.prefill), ready or not."""
        ...

    async def write_prefill_replicas(self, target: Target, replicas: int) -> None:
        """Set spec.prefill.replicas (the operator sizes the prefill Deployment from it)."""
        ...

    async def write_status(self, target: Target, autoscaler: dict[str, Any]) -> None:
        """Merge `autoscaler` into status.autoscaler (a None value removes a field)."""
        ...

    async def write_adapters(
        self, target: AdapterTarget, adapters: list[dict[str, Any]] | None
    ) -> None:
        """Replace status.adapters (None removes it)."""
        ...

    async def record_event(self, target: Target, reason: str, message: str) -> None:
        """Tell people why the replica count changed (an Event, a log line)."""
        ...
