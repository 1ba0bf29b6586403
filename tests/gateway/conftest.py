"""Fixtures: fake engines and gateways, each a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from kubellm.gateway.discovery.base import Endpoint, FallbackTarget, FixedDiscovery, ModelTarget
from kubellm.gateway.http.app import Gateway, GatewaySettings, create_app
from kubellm.gateway.routing.scheduler import SchedulerSettings

from kubellm.api import SLO, Routing
from tests.fixtures.servers import ServerThread
from tests.gateway.upstream import FakeEngine

_CORE_FIELDS = frozenset(f.name for f in dataclasses.fields(SchedulerSettings))


class GatewayHandle:
    def __init__(self, gateway: Gateway, discovery: FixedDiscovery, server: ServerThread) -> None:
        self.gateway = gateway
        self.discovery = discovery
        self.server = server
        self.url = server.url

    def client(self, **kw: Any) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 20)
        return openai.OpenAI(base_url=f"{self.url}/v1", **kw)

    def update(self, models: dict[str, ModelTarget]) -> None:
        self.server.call(lambda: self.discovery.update(models))

    def metric(self, name: str, **labels: str) -> float:
        value = self.gateway.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


def model(
    name: str,
    engines: list[ServerThread | str],
    policy: str = "prefix-aware",
    fallback: FallbackTarget | None = None,
    slo: SLO | None = None,
    draining: frozenset[str] = frozenset(),
    load_bound: float = 1.25,
) -> ModelTarget:
    urls = [e if isinstance(e, str) else e.url for e in engines]
    return ModelTarget(
        served_name=name,
        deployment=name,
        endpoints=tuple(Endpoint(u, u in draining) for u in urls),
        routing=Routing(policy=policy, load_bound=load_bound),
        fallback=fallback,
        slo=slo or SLO(),
    )


@pytest.fixture
def engines() -> Iterator[Callable[[int], list[tuple[FakeEngine, ServerThread]]]]:
    started: list[ServerThread] = []

    def start(count: int, prefix: str = "e") -> list[tuple[FakeEngine, ServerThread]]:
        out = []
        for _ in range(count):
            engine = FakeEngine(f"{prefix}{len(started)}")
            server = ServerThread(engine.app()).start()
            started.append(server)
            out.append((engine, server))
        return out

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def gateway() -> Iterator[Callable[..., GatewayHandle]]:
    started: list[ServerThread] = []

    def start(models: dict[str, ModelTarget], **settings: Any) -> GatewayHandle:
        """`settings`: the gateway's and the routing core's fields, by name."""
        settings.setdefault("scrape_interval", 0.05)
        core = {k: settings.pop(k) for k in list(settings) if k in _CORE_FIELDS}
        discovery = FixedDiscovery(models)
        gw = Gateway(discovery, GatewaySettings(scheduler=SchedulerSettings(**core), **settings))
        server = ServerThread(create_app(gw)).start()
        started.append(server)
        return GatewayHandle(gw, discovery, server)

    yield start
    for server in started:
        server.stop()
