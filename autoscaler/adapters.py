"""`status.adapters`: on how many ready replicas each adapter of `spec.adapters` is loaded.

The autoscaler writes it because it is the component that already reads every ready
replica of a deployment each period (its EndpointSlices, its `/metrics`, where
`vllm:lora_requests_info` is) and already merges a field of the LLMDeployment's status
(`status.autoscaler`) through the status subresource. The gateway sees the same replicas
but writes nothing to Kubernetes (and may run as many replicas, which would race); the
operator writes the rest of the status but reads no engine.

Per adapter: `loadedReplicas` (replicas whose `/v1/models` lists it: vLLM can serve it
there, from a `--lora-modules` flag or a runtime load), `activeReplicas` (replicas with
requests for it running or waiting now, from `vllm:lora_requests_info`) and `replicas`
(the ready replicas looked at). A replica that does not answer counts in `replicas` and
in neither count.

Pure: `replica_adapters` (a replica's answers -> what it holds) and `adapter_status`
(replicas -> the status list); `observe` is the I/O edge.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from kubellm.autoscaler import observe

from kubellm.contracts import registered_adapters
from kubellm.metrics import parse_lora_info

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaAdapters:
    """The adapters one ready replica holds: `loaded` None when its /v1/models is unknown."""

    loaded: frozenset[str] | None
    active: frozenset[str] = frozenset()


def replica_adapters(models: object, metrics_text: str | None, served_name: str) -> ReplicaAdapters:
    """From a replica's `/v1/models` answer (parsed JSON, None when it failed) and its
    `/metrics` text (None when the scrape failed)."""
    loaded = registered_adapters(models, served_name) if models is not None else None
    active: frozenset[str] = frozenset()
    if metrics_text is not None:
        try:
            info = parse_lora_info(metrics_text)
        except ValueError:  # not Prometheus text: nothing known to be active
            info = None
        if info is not None:
            active = info.running | info.waiting
    return ReplicaAdapters(None if loaded is None else frozenset(loaded), active)


def adapter_status(
    wanted: Sequence[str], replicas: Sequence[ReplicaAdapters]
) -> list[dict[str, Any]] | None:
    """status.adapters (camelCase, in spec order) for the adapters `wanted`; None when the
    deployment lists none (the field is removed)."""
    if not wanted:
        return None
    return [
        {
            "name": name,
            "loadedReplicas": sum(1 for r in replicas if r.loaded is not None and name in r.loaded),
            "activeReplicas": sum(1 for r in replicas if name in r.active),
            "replicas": len(replicas),
        }
        for name in wanted
    ]


async def models(client: httpx.AsyncClient, url: str) -> object:
    """A replica's `/v1/models` answer (parsed), None on any failure."""
    body = await observe.fetch(client, f"{url}/v1/models")
    if body is None:
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        log.info("adapters of %s unknown: %s", url, error)
        return None
