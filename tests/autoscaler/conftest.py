"""Fixtures for the autoscaler: Prometheus endpoints on 127.0.0.1 and the Kubernetes emulator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kubellm import api, metrics
from tests.fixtures import rbac
from tests.fixtures.polling import eventually

RBAC_FILE = Path(__file__).resolve().parents[2] / "autoscaler" / "rbac-requests.yaml"

LLMD = f"{api.GROUP}/{api.VERSION}/{api.PLURAL}"
SLICES = "discovery.k8s.io/v1/endpointslices"
EVENTS = "v1/events"


def engine_text(waiting: float, running: float, kv: float, engines: int = 1) -> str:
    """vLLM-style exposition text: one gauge sample per engine core."""
    lines = []
    for name, value in (
        (metrics.NUM_REQUESTS_WAITING, waiting),
        (metrics.NUM_REQUESTS_RUNNING, running),
        (metrics.KV_CACHE_USAGE, kv),
    ):
        lines.append(f"# HELP {name} test\n# TYPE {name} gauge")
        for engine in range(engines):
            lines.append(f'{name}{{model_name="tiny",engine="{engine}"}} {value / engines}')
    return "\n".join(lines) + "\n"


def gateway_text(pending: dict[str, float], answered: dict[str, float] | None = None) -> str:
    """The gateway's pending gauge and (where given) its answered-requests counter per model."""
    lines = [f"# HELP {metrics.GATEWAY_PENDING} test", f"# TYPE {metrics.GATEWAY_PENDING} gauge"]
    for model, value in pending.items():
        labels = f'model="{model}",deployment="{model}",namespace="default"'
        lines.append(f"{metrics.GATEWAY_PENDING}{{{labels}}} {value}")
    counter = metrics.GATEWAY_REQUESTS
    lines.append(f"# TYPE {counter.removesuffix('_total')} counter")
    for model, value in (answered or {}).items():
        labels = f'model="{model}",deployment="{model}",namespace="default"'
        # split over two routes: every answered request counts, whatever served it
        lines.append(f'{counter}{{{labels},target="replica",code="200"}} {value - 1}')
        lines.append(f'{counter}{{{labels},target="fallback",code="200"}} 1')
    return "\n".join(lines) + "\n"


class MetricsServer:
    """A /metrics endpoint on 127.0.0.1 serving whatever `text` (and `status`) the test sets,
    and a /v1/models answering `models` (404 while it is None)."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        self.status = 200
        self.scrapes = 0
        self.models: Any = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def _metrics(self, _: Request) -> Response:
        self.scrapes += 1
        return PlainTextResponse(self.text, status_code=self.status)

    async def _models(self, _: Request) -> Response:
        if self.models is None:
            return PlainTextResponse("not found", status_code=404)
        return JSONResponse(self.models)

    async def start(self) -> None:
        app = Starlette(
            routes=[Route("/metrics", self._metrics), Route("/v1/models", self._models)]
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._task = asyncio.create_task(self._server.serve())
        server, task = self._server, self._task
        await eventually(lambda: server.started or task.done(), what="the metrics server")
        assert server.started, "metrics server failed to start"

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._task, timeout=10)


@pytest.fixture
async def metrics_server() -> AsyncIterator[Callable[[str], Awaitable[MetricsServer]]]:
    """Start as many metrics servers as a test needs; all stop at teardown."""
    servers: list[MetricsServer] = []

    async def start(text: str = "") -> MetricsServer:
        server = MetricsServer(text)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
def cluster(kmock: Any) -> Iterator[Any]:
    """The emulator with the resources the autoscaler reads and writes.

    Tests put objects into it directly, so every HTTP request in its log is the
    autoscaler's: each must be listed in autoscaler/rbac-requests.yaml, which the
    Helm chart's RBAC is tested against.
    """
    kmock.resources[LLMD] = kmock.ResourceInfo(
        kind=api.KIND, namespaced=True, subresources={"status", "scale"}
    )
    kmock.resources[SLICES] = kmock.ResourceInfo(kind="EndpointSlice", namespaced=True)
    kmock.resources[EVENTS] = kmock.ResourceInfo(kind="Event", namespaced=True)
    yield kmock
    missing = rbac.recorded(kmock) - rbac.rules(RBAC_FILE)
    assert not missing, f"requests missing from {RBAC_FILE}: {sorted(missing)}"


def llmd(name: str = "tiny", replicas: int = 1, **autoscaling: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"source": "hf://org/tiny"}, "replicas": replicas}
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def endpoint_slice(
    deployment: str, port: int, ready: list[bool], suffix: str = "a"
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{deployment}-{suffix}",
            "namespace": "default",
            "labels": {"kubellm.io/deployment": deployment},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": ["127.0.0.1"],
                "conditions": {"ready": r},
                "targetRef": {"kind": "Pod", "name": f"{deployment}-{suffix}-{i}"},
            }
            for i, r in enumerate(ready)
        ],
    }
