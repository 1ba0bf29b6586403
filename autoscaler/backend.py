"""The loop's view of the world: what to scale, where its replicas are, how to write.

The control loop talks only to a `Backend`. `KubernetesBackend`
(`kubellm.autoscaler.kube_backend`) reads LLMDeployments and EndpointSlices
and writes /scale, status and Events through the API server; a local fleet
(no Kubernetes) implements the same five methods over its own processes, and
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

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Endpoint:
    """One engine replica: where its Prometheus metrics are, and whether it is ready."""

    name: str
    metrics_url: str
    ready: bool


class Backend(Protocol):
    async def targets(self) -> list[Target]:
        """Deployments whose autoscaling is enabled."""
        ...

    async def endpoints(self, target: Target) -> list[Endpoint]:
        """The target's engine replicas, ready or not."""
        ...

    async def write_replicas(self, target: Target, replicas: int) -> None:
        """Set the desired replica count (the /scale subresource)."""
        ...

    async def write_status(self, target: Target, autoscaler: dict[str, Any]) -> None:
        """Merge `autoscaler` into status.autoscaler (a None value removes a field)."""
        ...

    async def record_event(self, target: Target, reason: str, message: str) -> None:
        """Tell people why the replica count changed (an Event, a log line)."""
        ...
