"""The loop's view of the world: what to scale, where its replicas are, how to write.

The control loop talks only to a `Backend`. `KubernetesBackend`
(`kubellm.autoscaler.kube_backend`) reads LLMDeployments and EndpointSlices
and writes /scale, status and Events through the API server; a local fleet
(no Kubernetes) implements the same seven methods over its own processes, and
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
