"""The few Kubernetes API calls the reconciler makes, over httpx.

kopf watches and calls the handlers; this client reads and writes the
children. Every request it can make is listed in operator/rbac-requests.yaml.
Errors come back as `ApiError` with the HTTP status, so callers can tell a
transient failure (retry) from a permanent one (report in status).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx

from kubellm import __version__, api

from .builders import FIELD_MANAGER

# apiVersion -> (API path prefix) and kind -> plural, for the kinds the operator touches.
PLURALS = {
    "ConfigMap": "configmaps",
    "Deployment": "deployments",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "PodMonitor": "podmonitors",
    "InferencePool": "inferencepools",
    "HTTPRoute": "httproutes",
    "LeaderWorkerSet": "leaderworkersets",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "Pod": "pods",
    "Secret": "secrets",
    api.KIND: api.PLURAL,
}


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def transient(self) -> bool:
        """Worth retrying: conflicts, throttling, server errors, no connection (status 0)."""
        return self.status in (0, 409, 429) or self.status >= 500


def path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    out = f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}"
    return f"{out}/{name}" if name else out


class Client:
    """An async client for the operator's requests; owns its httpx client."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.http.headers["User-Agent"] = f"{FIELD_MANAGER}/{__version__}"

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self.http.request(method, url, **kwargs)
        except (httpx.HTTPError, RuntimeError) as error:  # RuntimeError: closed at shutdown
            raise ApiError(0, f"{method} {url}: {error}") from error
        if response.status_code >= 400:
            try:
                message = response.json().get("message") or response.text
            except (ValueError, AttributeError):
                message = response.text
            raise ApiError(response.status_code, f"{method} {url}: {message}")
        return response

    async def get(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            response = await self._request("GET", path(api_version, kind, namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        return response.json()

    async def list(
        self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        response = await self._request(
            "GET", path(api_version, kind, namespace), params={"labelSelector": selector}
        )
        items = response.json().get("items") or []
        # Filter again: a selector is a request, not a guarantee from every server.
        return [
            item
            for item in items
            if all(
                item.get("metadata", {}).get("labels", {}).get(k) == v for k, v in labels.items()
            )
        ]

    async def apply(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply: create or update the fields the operator manages."""
        meta = body["metadata"]
        response = await self._request(
            "PATCH",
            path(body["apiVersion"], body["kind"], meta["namespace"], meta["name"]),
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content=json.dumps(body),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        return response.json()

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        try:
            await self._request(
                "DELETE",
                path(api_version, kind, namespace, name),
                params={"propagationPolicy": "Background"},
            )
        except ApiError as error:
            if error.status != 404:
                raise

    async def patch_merge(
        self, api_version: str, kind: str, namespace: str, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """A JSON merge patch of one object (a stable Deployment's replicas during a canary
        rollout; removing the LLMDeployment's rollout-action annotation once acted on)."""
        response = await self._request(
            "PATCH",
            path(api_version, kind, namespace, name),
            params={"fieldManager": FIELD_MANAGER},
            content=json.dumps(body),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return response.json()

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patch the LLMDeployment's status subresource."""
        await self._request(
            "PATCH",
            path(api.API_VERSION, api.KIND, namespace, name) + "/status",
            content=json.dumps({"status": status}),
            headers={"Content-Type": "application/merge-patch+json"},
        )

    async def has_resource(self, api_version: str, plural: str) -> bool:
        """API discovery: whether the server serves `plural` in `api_version` (a CRD check)."""
        try:
            response = await self._request("GET", f"/apis/{api_version}")
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in response.json().get("resources") or [])
