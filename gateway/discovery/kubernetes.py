"""Kubernetes discovery: LLMDeployments for settings, EndpointSlices for engines.

- An `LLMDeployment` gives a model: served name (`spec.model.servedName` or
  `metadata.name`), `spec.routing`, `spec.fallback` (its key read from the
  Secret in `apiKeySecretRef`), `spec.slo`.
- EndpointSlices labelled `kubellm.io/deployment=<name>` in the same
  namespace give its engines: the port named `http`, and per endpoint the
  conditions: `ready` -> routable; `serving` and `terminating` -> draining (no
  new requests, in-flight ones finish); otherwise left out.
- Its status gives the canary split (`status.rollout`) and the decode bound
  (`status.capacity.decodeTokensPerSecondBound`, the slo-aware latency model's prior).

`build_targets` is the pure half; `KubernetesDiscovery` lists and watches both
resources with httpx (re-listing after any error) and rebuilds on each change.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx
from kubellm.gateway.discovery.base import (
    AdapterRef,
    CanarySplit,
    Endpoint,
    ModelTarget,
    canary_split,
    prefill_split,
)

from kubellm import kube
from kubellm.api import LLMDeployment, LLMDeploymentSpec
from kubellm.contracts import (
    DECODE_ROLE,
    DEPLOYMENT_LABEL,
    PREFILL_ROLE,
    REVISION_LABEL,
    ROLE_LABEL,
    fallback_target,
    slice_endpoints,
)
from kubellm.manifests import ManifestError, parse
from kubellm.sources import adapter_path

log = logging.getLogger(__name__)

SecretKey = tuple[str, str, str]  # namespace, secret name, key


def endpoints_of(slice_: Mapping[str, Any]) -> list[Endpoint]:
    """Engine URLs of one EndpointSlice (port `http`): ready ones, and draining ones
    (serving while terminating: they finish what they have), with the slice's revision
    label (a canary Service's slices carry it) and role label (spec.prefill's roles)."""
    labels = (slice_.get("metadata") or {}).get("labels") or {}
    revision = labels.get(REVISION_LABEL) or None
    role = labels.get(ROLE_LABEL) if labels.get(ROLE_LABEL) in (PREFILL_ROLE, DECODE_ROLE) else None
    return [
        Endpoint(e.url, draining=not e.routable, revision=revision, role=role)
        for e in slice_endpoints(slice_)
        if e.routable or e.draining
    ]


def secret_keys(deployments: list[LLMDeployment]) -> set[SecretKey]:
    keys = set()
    for d in deployments:
        ref = d.spec.fallback.api_key_secret_ref if d.spec.fallback else None
        if ref is not None:
            keys.add((d.metadata.namespace, ref.name, ref.key))
    return keys


def parse_deployments(items: list[Mapping[str, Any]]) -> list[LLMDeployment]:
    """Valid LLMDeployments of a list; an invalid one is logged and skipped."""
    out = []
    for item in items:
        document = {k: v for k, v in item.items() if k != "status"}
        document["metadata"] = {
            "name": item.get("metadata", {}).get("name", ""),
            "namespace": item.get("metadata", {}).get("namespace", "default"),
        }
        try:
            out.append(parse(document, f"LLMDeployment {document['metadata']['name']}"))
        except ManifestError as error:
            log.warning("skipping %s", error)
    return out


def canary_splits(items: list[Mapping[str, Any]]) -> dict[tuple[str, str], CanarySplit]:
    """(namespace, name) -> the canary split its status.rollout asks for."""
    out = {}
    for item in items:
        meta = item.get("metadata") or {}
        split = canary_split((item.get("status") or {}).get("rollout"))
        if split is not None:
            out[meta.get("namespace", "default"), meta.get("name", "")] = split
    return out


def decode_bounds(items: list[Mapping[str, Any]]) -> dict[tuple[str, str], float]:
    """(namespace, name) -> its status.capacity.decodeTokensPerSecondBound, where the
    operator wrote a positive one."""
    out = {}
    for key, capacity in _capacities(items):
        bound = capacity.get("decodeTokensPerSecondBound")
        number = isinstance(bound, (int, float)) and not isinstance(bound, bool)
        if number and bound > 0 and math.isfinite(bound):
            out[key] = float(bound)
    return out


def tier_tokens(items: list[Mapping[str, Any]]) -> dict[tuple[str, str], tuple[int, int]]:
    """(namespace, name) -> its status.capacity (kvTokensGPU, kvTokensHost), where the
    operator wrote both as positive integers (a replica with a host-memory tier)."""
    out = {}
    for key, capacity in _capacities(items):
        pair = capacity.get("kvTokensGPU"), capacity.get("kvTokensHost")
        if all(type(v) is int and v > 0 for v in pair):
            out[key] = pair
    return out


def _capacities(
    items: list[Mapping[str, Any]],
) -> Iterator[tuple[tuple[str, str], Mapping[str, Any]]]:
    """(namespace, name) and status.capacity of each item that has one."""
    for item in items:
        meta = item.get("metadata") or {}
        capacity = (item.get("status") or {}).get("capacity")
        if isinstance(capacity, Mapping):
            yield (meta.get("namespace", "default"), meta.get("name", "")), capacity


def build_targets(
    deployments: list[LLMDeployment],
    slices: list[Mapping[str, Any]],
    keys: Mapping[SecretKey, str],
    splits: Mapping[tuple[str, str], CanarySplit] | None = None,
    bounds: Mapping[tuple[str, str], float] | None = None,
    tiers: Mapping[tuple[str, str], tuple[int, int]] | None = None,
) -> dict[str, ModelTarget]:
    """Served name -> target. A served name claimed twice goes to the first by namespace/name.
    A canary pod is in two slices (the engine Service's and the canary's): its revision
    comes from the labelled one."""
    by_owner: dict[tuple[str, str], dict[str, Endpoint]] = {}
    for s in slices:
        meta = s.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(DEPLOYMENT_LABEL)
        if owner:
            bucket = by_owner.setdefault((meta.get("namespace", "default"), owner), {})
            for e in endpoints_of(s):
                known = bucket.get(e.url)
                if known is None:
                    bucket[e.url] = e
                elif e.revision and not known.revision:
                    bucket[e.url] = Endpoint(e.url, known.draining and e.draining,
                                             known.kv_events_port, e.revision,
                                             role=known.role or e.role)  # fmt: skip
    targets: dict[str, ModelTarget] = {}
    for d in sorted(deployments, key=lambda d: (d.metadata.namespace, d.metadata.name)):
        name = d.served_name
        if name in targets:
            log.warning("served name %r is claimed twice; %s/%s ignored", name,
                        d.metadata.namespace, d.metadata.name)  # fmt: skip
            continue
        ref = d.spec.fallback.api_key_secret_ref if d.spec.fallback else None
        key = keys.get((d.metadata.namespace, ref.name, ref.key)) if ref else None
        fallback = fallback_target(d.spec.fallback, key)
        endpoints = list(by_owner.get((d.metadata.namespace, d.metadata.name), {}).values())
        targets[name] = ModelTarget(
            served_name=name,
            deployment=d.metadata.name,
            namespace=d.metadata.namespace,
            endpoints=tuple(sorted(endpoints, key=lambda e: e.url)),
            routing=d.spec.routing,
            fallback=fallback,
            slo=d.spec.slo,
            adapters=adapter_refs(d.spec),
            model_source=d.spec.model.source,
            canary=(splits or {}).get((d.metadata.namespace, d.metadata.name)),
            decode_tokens_per_second_bound=(bounds or {}).get(
                (d.metadata.namespace, d.metadata.name)
            ),
            prefill=prefill_split(d.spec),
            kv_tier_tokens=(tiers or {}).get((d.metadata.namespace, d.metadata.name)),
        )
    return targets


def adapter_refs(spec: LLMDeploymentSpec) -> tuple[AdapterRef, ...]:
    """spec.adapters as the paths an engine pod loads them from; an adapter the engine
    cannot load (s3://) is left out (the launcher and the operator say why)."""
    refs = []
    for adapter in spec.adapters:
        try:
            refs.append(AdapterRef(adapter.name, adapter_path(adapter.source, spec.model.source)))
        except ValueError:
            continue
    return tuple(refs)


class KubernetesDiscovery:
    """Lists and watches LLMDeployments and EndpointSlices; the snapshot follows them."""

    def __init__(
        self,
        config: kube.KubeConfig,
        namespace: str | None = None,
        client: httpx.AsyncClient | None = None,
        retry_seconds: float = 2.0,
        read_fallback_keys: bool = True,
    ) -> None:
        self.config = config
        self.namespace = namespace
        self.client = client
        self.retry_seconds = retry_seconds
        # False: fallback targets carry no API key and no Secret is read (the endpoint
        # picker hands overflow to a forwarder that holds the keys).
        self.read_fallback_keys = read_fallback_keys
        self._deployments: dict[str, Mapping[str, Any]] = {}
        self._slices: dict[str, Mapping[str, Any]] = {}
        self._keys: dict[SecretKey, str] = {}
        self._models: dict[str, ModelTarget] = {}

    def snapshot(self) -> Mapping[str, ModelTarget]:
        return self._models

    def _paths(self) -> tuple[str, str]:
        ns = self.namespace
        slices = (
            f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
            if ns
            else "/apis/discovery.k8s.io/v1/endpointslices"
        )
        return kube.llmd_path(ns), slices

    async def _read_keys(self, client: httpx.AsyncClient, wanted: set[SecretKey]) -> None:
        for ns, name, key in wanted - set(self._keys):
            try:
                response = await client.get(f"/api/v1/namespaces/{ns}/secrets/{name}")
                response.raise_for_status()
                data = response.json().get("data") or {}
                if key in data:
                    self._keys[(ns, name, key)] = base64.b64decode(data[key]).decode()
                else:
                    log.warning("secret %s/%s has no key %r", ns, name, key)
            except (httpx.HTTPError, ValueError) as error:
                log.warning("cannot read secret %s/%s: %s", ns, name, type(error).__name__)
        for stale in set(self._keys) - wanted:
            del self._keys[stale]

    async def _rebuild(self, client: httpx.AsyncClient, on_change: Callable[[], None]) -> None:
        deployments = parse_deployments(list(self._deployments.values()))
        if self.read_fallback_keys:
            await self._read_keys(client, secret_keys(deployments))
        items = list(self._deployments.values())
        self._models = build_targets(
            deployments, list(self._slices.values()), self._keys, canary_splits(items),
            decode_bounds(items), tier_tokens(items),
        )  # fmt: skip
        on_change()

    async def _follow(
        self,
        client: httpx.AsyncClient,
        path: str,
        store: dict[str, Mapping[str, Any]],
        changed: Callable[[], Any],
    ) -> None:
        """List then watch `path` into `store`, forever; re-list after any error or 410."""
        while True:
            try:
                listed = await client.get(path)
                listed.raise_for_status()
                body = listed.json()
                store.clear()
                for item in body.get("items") or []:
                    store[_key(item)] = item
                await changed()
                version = body.get("metadata", {}).get("resourceVersion", "")
                params = {"watch": "1", "resourceVersion": version, "allowWatchBookmarks": "1"}
                async with client.stream("GET", path, params=params, timeout=None) as stream:
                    async for line in stream.aiter_lines():
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        kind, obj = event.get("type"), event.get("object") or {}
                        if kind in ("ADDED", "MODIFIED"):
                            store[_key(obj)] = obj
                        elif kind == "DELETED":
                            store.pop(_key(obj), None)
                        elif kind == "ERROR":
                            break
                        else:
                            continue
                        await changed()
            except (httpx.HTTPError, ValueError) as error:
                log.warning("watch %s failed: %s", path, type(error).__name__)
            await asyncio.sleep(self.retry_seconds)

    async def run(self, on_change: Callable[[], None]) -> None:
        client = self.client or kube.async_client(self.config)
        lock = asyncio.Lock()

        async def changed() -> None:
            async with lock:
                await self._rebuild(client, on_change)

        deployments_path, slices_path = self._paths()
        try:
            await asyncio.gather(
                self._follow(client, deployments_path, self._deployments, changed),
                self._follow(client, slices_path, self._slices, changed),
            )
        finally:
            if self.client is None:
                await client.aclose()


def _key(item: Mapping[str, Any]) -> str:
    meta = item.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"
