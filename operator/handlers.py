"""kopf wiring: which events trigger a reconcile, and how errors retry.

`register(registry, connect=...)` adds every handler to a kopf registry, so
the CLI and the tests each build their own operator. Triggers, all running the
same idempotent `reconcile.reconcile`:
- LLMDeployment created, updated (spec, including /scale writes) or resumed;
- a periodic resync timer (catches pod-level problems and missed events);
- any event on a child (Deployment, Service, ConfigMap, PDB) labelled as
  managed by the operator: a hand edit is put back, a rollout updates status
  (a pool picker's ServiceAccount, Role and RoleBinding are not watched: the
  resync timer puts them back).

Reconciles of one LLMDeployment never overlap, and a burst of triggers
collapses into one queued reconcile, which reads the latest state anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kubellm import api, kube

from . import builders
from .client import ApiError, Client
from .reconcile import Figures, Outcome, reconcile

MANAGED = {"app.kubernetes.io/managed-by": "kubellm-operator"}
CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),  # where its CRD is installed
)
PODMONITOR_CHECK_SECONDS = 300.0
# status.rollout phases during which a canary rollout is re-evaluated every rollout_seconds.
ACTIVE_PHASES = ("Progressing", "Promoting")


@dataclass
class Runtime:
    """Per-operator state: the API client, per-object locks, the PodMonitor CRD check."""

    client: Client
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    queued: set[tuple[str, str]] = field(default_factory=set)
    podmonitor: bool = False
    podmonitor_checked: float = float("-inf")
    lws: bool = False
    lws_checked: float = float("-inf")
    retry_seconds: float = 5.0
    # The Inference Extension's InferencePool and Gateway API's HTTPRoute CRDs, checked
    # as rarely as the PodMonitor CRD.
    gateway_crds: tuple[bool, bool] = (False, False)
    gateway_crds_checked: float = float("-inf")
    # The gateway's per-revision counters, for the canary analysis (None: not configured).
    figures: Figures | None = None
    # How a pool's own endpoint picker runs (or the shared one pools use).
    picker: builders.PickerOptions = field(default_factory=builders.PickerOptions)

    async def podmonitor_installed(self) -> bool:
        if time.monotonic() - self.podmonitor_checked > PODMONITOR_CHECK_SECONDS:
            api_version = builders.PODMONITOR_API_VERSION
            self.podmonitor = await self.client.has_resource(api_version, "podmonitors")
            self.podmonitor_checked = time.monotonic()
        return self.podmonitor

    async def lws_installed(self) -> bool:
        """The LeaderWorkerSet CRD, checked as rarely as the PodMonitor CRD."""
        if time.monotonic() - self.lws_checked > PODMONITOR_CHECK_SECONDS:
            self.lws = await self.client.has_resource(builders.LWS_API_VERSION, "leaderworkersets")
            self.lws_checked = time.monotonic()
        return self.lws

    async def gateway_crds_installed(self) -> tuple[bool, bool]:
        if time.monotonic() - self.gateway_crds_checked > PODMONITOR_CHECK_SECONDS:
            pools = await self.client.has_resource(
                builders.INFERENCE_POOL_API_VERSION, "inferencepools"
            )
            routes = await self.client.has_resource(builders.HTTPROUTE_API_VERSION, "httproutes")
            self.gateway_crds = (pools, routes)
            self.gateway_crds_checked = time.monotonic()
        return self.gateway_crds

    async def reconcile(self, namespace: str, name: str) -> Outcome | None:
        key = (namespace, name)
        if key in self.queued:
            return None  # a reconcile is already waiting; it will see this change too
        self.queued.add(key)
        lock = self.locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                self.queued.discard(key)
                pools, routes = await self.gateway_crds_installed()
                return await reconcile(
                    self.client,
                    namespace,
                    name,
                    podmonitor=await self.podmonitor_installed(),
                    inference_pool=pools,
                    http_route=routes,
                    leader_worker_set=await self.lws_installed(),
                    picker=self.picker,
                    emit=_emit,
                    figures=self.figures,
                )
        except ApiError as error:
            if error.transient:
                raise kopf.TemporaryError(str(error), delay=self.retry_seconds) from error
            raise kopf.PermanentError(str(error)) from error
        finally:
            self.queued.discard(key)


def _emit(body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    kopf.event(dict(body), type=kind, reason=reason, message=message[:1024])


def _connection(config: kube.KubeConfig) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(
        server=config.server,
        token=config.token,
        ca_path=config.ca_file,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
        insecure=config.insecure or None,
        default_namespace=config.namespace,
    )


def register(
    registry: kopf.OperatorRegistry,
    *,
    connect: Callable[[], kube.KubeConfig] = kube.load,
    resync_seconds: float = 60.0,
    retry_seconds: float = 5.0,
    rollout_seconds: float = 5.0,
    figures: Callable[[], Figures | None] = lambda: None,
    picker: builders.PickerOptions | None = None,
) -> None:
    """Add the operator's handlers to `registry`; `connect` says where the API server is;
    `figures` makes the canary analysis' source of per-revision counters (at startup);
    `picker` says how a pool's own endpoint picker runs."""
    resource = (api.GROUP, api.VERSION, api.PLURAL)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return _connection(connect())

    @kopf.on.startup(registry=registry)
    async def startup(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.INFO  # Events for explicit kopf.event() calls
        settings.persistence.finalizer = f"{api.GROUP}/finalizer"
        client = Client(kube.async_client(connect()))
        memo.runtime = Runtime(
            client,
            retry_seconds=retry_seconds,
            figures=figures(),
            picker=picker or builders.PickerOptions(),
        )

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        runtime: Runtime | None = memo.get("runtime")
        if runtime is not None:
            await runtime.client.aclose()
            closer = getattr(runtime.figures, "aclose", None)
            if closer is not None:
                await closer()

    @kopf.on.create(*resource, registry=registry)
    @kopf.on.update(*resource, registry=registry)
    @kopf.on.resume(*resource, registry=registry)
    async def changed(memo: kopf.Memo, namespace: str, name: str, **_: Any) -> None:
        await memo.runtime.reconcile(namespace, name)

    @kopf.timer(*resource, interval=resync_seconds, registry=registry)
    async def resync(memo: kopf.Memo, namespace: str, name: str, **_: Any) -> None:
        await memo.runtime.reconcile(namespace, name)

    def rolling_out(status: Mapping[str, Any], **_: Any) -> bool:
        return ((status or {}).get("rollout") or {}).get("phase") in ACTIVE_PHASES

    @kopf.timer(*resource, interval=rollout_seconds, when=rolling_out, registry=registry)
    async def canary(memo: kopf.Memo, namespace: str, name: str, **_: Any) -> None:
        """A canary step's analysis and pause run on time, not only on events."""
        await memo.runtime.reconcile(namespace, name)

    for group, version, plural in CHILD_RESOURCES:
        where = (f"{group}/{version}", plural) if group else (version, plural)

        @kopf.on.event(*where, labels=MANAGED, registry=registry)
        async def child(
            memo: kopf.Memo,
            namespace: str,
            labels: Mapping[str, str],
            event: Mapping[str, Any],
            **_: Any,
        ) -> None:
            owner = labels.get(builders.DEPLOYMENT_LABEL)
            if owner and event.get("type") is not None:  # None: the initial listing
                await memo.runtime.reconcile(namespace, owner)
