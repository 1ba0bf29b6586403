"""The Kubernetes `Backend`: LLMDeployments, EndpointSlices, /scale, status, Events.

Plain HTTP with httpx against the API server (configuration from
`kubellm.kube`). The autoscaler writes only five things: the /scale
subresource, `status.autoscaler` and `status.adapters` (merge patches of those
fields alone, through the status subresource), spec.prefill.replicas (a merge patch
of that field alone: a custom resource has one scale subresource, the decode role's),
and Events; the operator owns the rest.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import httpx
import pydantic
from kubellm.autoscaler.backend import AdapterTarget, Endpoint, Target, target_for

from kubellm import api, contracts, kube
from kubellm.contracts import DEPLOYMENT_LABEL, PREFILL_ROLE, ROLE_LABEL

log = logging.getLogger(__name__)

COMPONENT = "kubellm-autoscaler"
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


class KubernetesBackend:
    def __init__(self, client: httpx.AsyncClient, namespace: str | None = None) -> None:
        """`client` has the API server as base URL; `namespace` None watches all of them."""
        self.client = client
        self.namespace = namespace

    async def targets(self) -> list[Target]:
        return [t for t in map(_target, await self._items()) if t is not None]

    async def adapter_targets(self) -> list[AdapterTarget]:
        return [t for t in map(_adapter_target, await self._items()) if t is not None]

    async def _items(self) -> list[dict[str, Any]]:
        """The LLMDeployments of the namespace (all namespaces when None), as listed."""
        response = await self.client.get(kube.llmd_path(self.namespace))
        response.raise_for_status()
        return response.json().get("items", [])

    async def endpoints(self, target: Target | AdapterTarget) -> list[Endpoint]:
        """The replicas serving whole requests (spec.prefill: the decode role's)."""
        return await self._endpoints(target, prefill=False)

    async def prefill_endpoints(self, target: Target) -> list[Endpoint]:
        return await self._endpoints(target, prefill=True)

    async def _endpoints(self, target: Target | AdapterTarget, prefill: bool) -> list[Endpoint]:
        """The slices' endpoints of the prefill role (ROLE_LABEL prefill: its Service's
        slices carry its labels) or of the rest."""
        selector = f"{DEPLOYMENT_LABEL}={target.name}"
        response = await self.client.get(
            f"/apis/discovery.k8s.io/v1/namespaces/{target.namespace}/endpointslices",
            params={"labelSelector": selector},
        )
        response.raise_for_status()
        found: dict[str, Endpoint] = {}
        for item in response.json().get("items", []):
            labels = item.get("metadata", {}).get("labels") or {}
            if labels.get(DEPLOYMENT_LABEL) != target.name:
                continue  # the server filters; this keeps a lax one honest
            if (labels.get(ROLE_LABEL) == PREFILL_ROLE) != prefill:
                continue
            for endpoint in slice_endpoints(item):  # one pod may sit in two slices (dual-stack)
                found.setdefault(endpoint.name, endpoint)
        return sorted(found.values(), key=lambda e: e.name)

    async def write_replicas(self, target: Target, replicas: int) -> None:
        response = await self.client.patch(
            kube.llmd_path(target.namespace, target.name, "scale"),
            json={"spec": {"replicas": replicas}},
            headers=MERGE_PATCH,
        )
        response.raise_for_status()

    async def write_prefill_replicas(self, target: Target, replicas: int) -> None:
        response = await self.client.patch(
            kube.llmd_path(target.namespace, target.name),
            json={"spec": {"prefill": {"replicas": replicas}}},
            headers=MERGE_PATCH,
        )
        response.raise_for_status()

    async def write_status(self, target: Target, autoscaler: dict[str, Any]) -> None:
        response = await self.client.patch(
            kube.llmd_path(target.namespace, target.name, "status"),
            json={"status": {"autoscaler": autoscaler}},
            headers=MERGE_PATCH,
        )
        response.raise_for_status()

    async def write_adapters(
        self, target: AdapterTarget, adapters: list[dict[str, Any]] | None
    ) -> None:
        response = await self.client.patch(
            kube.llmd_path(target.namespace, target.name, "status"),
            json={"status": {"adapters": adapters}},  # a merge patch replaces a list whole
            headers=MERGE_PATCH,
        )
        response.raise_for_status()

    async def record_event(self, target: Target, reason: str, message: str) -> None:
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{target.name}.", "namespace": target.namespace},
            "involvedObject": {
                "apiVersion": api.API_VERSION,
                "kind": api.KIND,
                "name": target.name,
                "namespace": target.namespace,
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        response = await self.client.post(
            f"/api/v1/namespaces/{target.namespace}/events", json=event
        )
        if response.is_error:  # an Event is advice: never fail a period on it
            log.warning("event for %s not recorded: HTTP %s", target.key, response.status_code)


def _target(item: dict[str, Any]) -> Target | None:
    """A Target from an LLMDeployment object; None when autoscaling is off or it is invalid."""
    meta = item.get("metadata", {})
    try:
        deployment = api.LLMDeployment.model_validate(item)
    except pydantic.ValidationError as error:
        log.warning(
            "skipping LLMDeployment %s/%s: %s", meta.get("namespace"), meta.get("name"), error
        )
        return None
    return target_for(deployment, dict((item.get("status") or {}).get("autoscaler") or {}))


def _adapter_target(item: dict[str, Any]) -> AdapterTarget | None:
    """An AdapterTarget from an LLMDeployment object: None when it lists no adapters and
    shows none in its status, or when it is invalid (logged by `targets`' reading)."""
    try:
        deployment = api.LLMDeployment.model_validate(item)
    except pydantic.ValidationError:
        return None
    status = (item.get("status") or {}).get("adapters")
    names = tuple(a.name for a in deployment.spec.adapters)
    if not names and not status:
        return None
    return AdapterTarget(
        namespace=deployment.metadata.namespace,
        name=deployment.metadata.name,
        served_name=deployment.served_name,
        adapters=names,
        status=status if isinstance(status, list) else None,
    )


def slice_endpoints(item: dict[str, Any]) -> list[Endpoint]:
    """The engine endpoints of one EndpointSlice, on its port named `http` and its
    data-parallel ranks' ports, named by their replica (pod or LeaderWorkerSet group: the
    loop folds a replica's ranks into one); ready means ready and not terminating."""
    return [
        Endpoint(name=e.replica, metrics_url=f"{e.url}/metrics", ready=e.routable)
        for e in contracts.slice_endpoints(item)
    ]
