"""The autoscaler's own Prometheus metrics: its inputs, its outputs, its reasons.

One `Telemetry` per loop, on its own registry (tests make many loops).
Labels: namespace and deployment (the LLMDeployment's name).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kubellm.autoscaler.backend import Target
from kubellm.autoscaler.policy import Decision
from prometheus_client import CollectorRegistry, Counter, Gauge

KV_CACHE_USAGE = "kubellm_autoscaler_kv_cache_usage"
QUEUE_DEPTH = "kubellm_autoscaler_queue_depth"
GATEWAY_PENDING = "kubellm_autoscaler_gateway_pending_requests"
READY_REPLICAS = "kubellm_autoscaler_ready_replicas"
STALE_REPLICAS = "kubellm_autoscaler_stale_replicas"
DESIRED_REPLICAS = "kubellm_autoscaler_desired_replicas"
DECISIONS = "kubellm_autoscaler_decisions"  # counter: exported with _total
SCALE_WRITES = "kubellm_autoscaler_scale_writes"  # counter
ERRORS = "kubellm_autoscaler_errors"  # counter, + stage


class Telemetry:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ("namespace", "deployment")
        r = self.registry
        self.kv = Gauge(
            KV_CACHE_USAGE, "Mean KV-cache usage of fresh ready replicas.", labels, registry=r
        )
        self.queue = Gauge(
            QUEUE_DEPTH, "Mean waiting requests per fresh ready replica.", labels, registry=r
        )
        self.pending = Gauge(
            GATEWAY_PENDING, "Requests the gateway holds for the model.", labels, registry=r
        )
        self.ready = Gauge(READY_REPLICAS, "Ready engine replicas seen.", labels, registry=r)
        self.stale = Gauge(
            STALE_REPLICAS, "Ready replicas whose metrics were not readable.", labels, registry=r
        )
        self.desired = Gauge(DESIRED_REPLICAS, "Replicas the policy decided.", labels, registry=r)
        self.decisions = Counter(
            DECISIONS, "Decisions, by reason.", (*labels, "reason"), registry=r
        )
        self.writes = Counter(SCALE_WRITES, "Writes of the /scale subresource.", labels, registry=r)
        self.errors = Counter(ERRORS, "Failed steps, by stage.", ("stage",), registry=r)

    def record(
        self,
        target: Target,
        decision: Decision,
        ready: int,
        stale: int,
        pending: float | None,
        wrote: bool,
    ) -> None:
        key = (target.namespace, target.name)
        for gauge, value in (
            (self.kv, decision.kv_cache_usage),
            (self.queue, decision.queue_depth),
            (self.pending, pending),
        ):
            if value is None:
                gauge.labels(*key).set(float("nan"))
            else:
                gauge.labels(*key).set(value)
        self.ready.labels(*key).set(ready)
        self.stale.labels(*key).set(stale)
        self.desired.labels(*key).set(decision.replicas)
        self.decisions.labels(*key, decision.reason).inc()
        if wrote:
            self.writes.labels(*key).inc()


def app(telemetry: Telemetry) -> Any:
    """A Starlette app serving /metrics (this registry) and /healthz."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    async def metrics(_: Any) -> Response:
        return Response(generate_latest(telemetry.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Any) -> Response:
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/metrics", metrics), Route("/healthz", healthz)])


async def serve(telemetry: Telemetry, host: str, port: int, stop: asyncio.Event) -> None:
    """Serve `app(telemetry)` until `stop` is set."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(app(telemetry), host=host, port=port, log_level="warning")
    )
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    serving = asyncio.create_task(server.serve())
    await stop.wait()
    server.should_exit = True
    await serving
