"""Kubernetes discovery against the Kubernetes API emulator: what it sees, and what it asks.

The requests the gateway makes are recorded from the emulator's log and must be
listed in gateway/rbac-requests.yaml, which the Helm chart's RBAC is tested against.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import httpx
from kubellm.gateway.discovery.kubernetes import KubernetesDiscovery

from kubellm import api, kube
from tests.fixtures import rbac

RBAC_FILE = Path(__file__).resolve().parents[3] / "gateway" / "rbac-requests.yaml"
LLMD = f"{api.GROUP}/{api.VERSION}/{api.PLURAL}"
SLICES = "discovery.k8s.io/v1/endpointslices"
SECRETS = "v1/secrets"


async def _until(predicate: Any, changed: asyncio.Event, timeout: float, what: str) -> None:
    """Re-check `predicate` each time discovery reports a change, up to `timeout`."""
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await changed.wait()
                changed.clear()
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def _deployment() -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "llama", "namespace": "default"},
        "spec": {
            "model": {"source": "hf://org/llama", "servedName": "llama-8b"},
            "fallback": {
                "url": "https://api.example.com/v1",
                "apiKeySecretRef": {"name": "fallback-api", "key": "api-key"},
            },
            "slo": {"ttftSeconds": 1.5},
        },
    }


def _slice(ready: bool, terminating: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "llama-engine-abc",
            "namespace": "default",
            "labels": {"kubellm.io/deployment": "llama"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": ["10.0.0.7"],
                "conditions": {"ready": ready, "serving": True, "terminating": terminating},
            }
        ],
    }


async def test_discovery_follows_the_cluster_and_asks_only_what_rbac_grants(kmock: Any) -> None:
    kmock.resources[LLMD] = kmock.ResourceInfo(kind=api.KIND, namespaced=True)
    kmock.resources[SLICES] = kmock.ResourceInfo(kind="EndpointSlice", namespaced=True)
    kmock.resources[SECRETS] = kmock.ResourceInfo(kind="Secret", namespaced=True)
    kmock.objects[SECRETS, "default", "fallback-api"] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "fallback-api", "namespace": "default"},
        "data": {"api-key": base64.b64encode(b"sk-from-secret").decode()},
    }
    kmock.objects[LLMD, "default", "llama"] = _deployment()
    kmock.objects[SLICES, "default", "llama-engine-abc"] = _slice(ready=True)

    config = kube.KubeConfig(server=str(kmock.url).rstrip("/"))
    async with httpx.AsyncClient(base_url=config.server, timeout=10) as client:
        discovery = KubernetesDiscovery(config, client=client, retry_seconds=0.1)
        changed = asyncio.Event()
        task = asyncio.create_task(discovery.run(changed.set))
        try:
            await _until(
                lambda: (
                    "llama-8b" in discovery.snapshot()
                    and discovery.snapshot()["llama-8b"].endpoints
                ),
                changed,
                10,
                "the model and its endpoint",
            )
            target = discovery.snapshot()["llama-8b"]
            assert [e.url for e in target.routable] == ["http://10.0.0.7:8000"]
            assert target.fallback is not None and target.fallback.api_key == "sk-from-secret"
            assert target.slo.ttft_seconds == 1.5
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    missing = rbac.recorded(kmock) - rbac.rules(RBAC_FILE)
    assert not missing, f"requests missing from {RBAC_FILE}: {sorted(missing)}"
    assert ("", "secrets", "get") in rbac.recorded(kmock)
