"""Fixtures of the fault-injection suite: misbehaving engines and gateway processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.faults.peers import GatewayProcess, RawEngine, Request


@pytest.fixture
def raw_engine() -> Iterator[Callable[..., RawEngine]]:
    started: list[RawEngine] = []

    def start(respond: Callable[[Request], bytes | None], **kw: Any) -> RawEngine:
        engine = RawEngine(respond, **kw).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


@pytest.fixture
def gateway_process(tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    started: list[GatewayProcess] = []

    def start(models: list[dict[str, Any]], *flags: str) -> GatewayProcess:
        gateway = GatewayProcess(tmp_path, models, *flags)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()
