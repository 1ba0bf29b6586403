"""Flow control's drops through a real `kubellm gateway --tenants` process (issue 39, items 1
and 2): a request flow control drops (band full, queue full, shed) is a 429 with
`Retry-After` and `x-kubellm-drop-reason`, counted per tenant; at the queue bound the newest
waiter of a lower sheddable band goes, not the high-priority newcomer; and a tenant that
fills its band's queue gives a place up to another tenant of that band.

The engine reports a deep queue (saturated), so every request waits at the gateway until
the test frees it; the replicas' figures come from a fake engine on loopback."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubellm.gateway.routing.flow import tenants

from tests.fixtures.engines import free_port
from tests.gateway.faults.peers import GatewayProcess

KEYS = {"chat": "sk-chat", "eval-a": "sk-eval-a", "eval-b": "sk-eval-b"}
PRIORITIES = {"chat": 10, "eval-a": -1, "eval-b": -1}
DEADLINE_S = 60.0


def tenants_file(directory: Path) -> Path:
    rows = [
        {"name": name, "priority": PRIORITIES[name], "apiKeys": [f"sha256:{tenants.digest(k)}"]}
        for name, k in KEYS.items()
    ]
    path = directory / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": rows}))
    return path


class Fleet:
    def __init__(self, gateway: GatewayProcess, metrics_url: str, engine: Any) -> None:
        self.gateway, self.metrics_url, self.engine = gateway, metrics_url, engine
        self.pool = concurrent.futures.ThreadPoolExecutor(8)

    def ask(self, tenant: str, timeout: float = DEADLINE_S) -> httpx.Response:
        return httpx.post(
            f"{self.gateway.url}/v1/completions",
            json={"model": "tiny", "prompt": f"from {tenant}", "max_tokens": 4},
            headers={"authorization": f"Bearer {KEYS[tenant]}"},
            timeout=timeout,
        )

    def later(self, tenant: str) -> concurrent.futures.Future[httpx.Response]:
        return self.pool.submit(self.ask, tenant)

    def dropped(self, tenant: str, reason: str) -> float:
        text = httpx.get(self.metrics_url, timeout=10).text
        line = f'kubellm_gateway_tenant_dropped_total{{reason="{reason}",tenant="{tenant}"}}'
        for row in text.splitlines():
            if row.startswith(line):
                return float(row.split()[-1])
        return 0.0


@pytest.fixture
def fleet(engines, tmp_path: Path) -> Iterator[Callable[..., Fleet]]:
    started: list[Fleet] = []

    def start(*flags: str) -> Fleet:
        ((engine, server),) = engines(1)
        engine.behaviour.waiting = 50  # saturated: requests wait at the gateway
        metrics_port = free_port()
        models = [{"name": "tiny", "endpoints": [server.url], "slo": {"ttftSeconds": 60}}]
        gateway = GatewayProcess(
            tmp_path, models, "--tenants", str(tenants_file(tmp_path)),
            "--metrics-port", str(metrics_port), "--band-ttl", "60", *flags,
        )  # fmt: skip
        fleet = Fleet(gateway, f"http://127.0.0.1:{metrics_port}/metrics", engine)
        started.append(fleet)
        return fleet

    yield start
    for fleet in started:
        fleet.engine.behaviour.waiting = 0  # whatever still waits goes now
        fleet.pool.shutdown(wait=True, cancel_futures=True)
        fleet.gateway.stop()


def fill(fleet: Fleet, tenant: str, places: int) -> list[concurrent.futures.Future]:
    """`places` + 1 requests of `tenant`: the one answered first is refused (`places`
    wait, the bound the flags set), and is returned first; the others wait."""
    asked = [fleet.later(tenant) for _ in range(places + 1)]
    refused = next(concurrent.futures.as_completed(asked, DEADLINE_S))
    return [refused, *(a for a in asked if a is not refused)]


def test_a_band_full_drop_is_a_429_with_its_reason_and_counted(fleet):
    f = fleet("--max-band-queue", "1")
    refused, waiting = fill(f, "eval-a", 1)
    answer = refused.result()
    assert answer.status_code == 429, answer.text
    assert answer.headers["x-kubellm-drop-reason"] == "band-full"
    assert int(answer.headers["retry-after"]) >= 1
    assert answer.json()["error"]["type"] == "rate_limit_error"
    assert f.dropped("eval-a", "band-full") == 1
    assert not waiting.done()
    f.engine.behaviour.waiting = 0
    assert waiting.result(DEADLINE_S).status_code == 200


def test_a_full_queue_sheds_the_newest_sheddable_waiter_for_a_high_priority_newcomer(fleet):
    f = fleet("--max-queue", "2")
    refused, *batch = fill(f, "eval-a", 2)  # the model's queue is full
    assert refused.result().status_code == 429
    chat = f.later("chat")  # priority 10: a sheddable waiter makes way for it
    shed = next(concurrent.futures.as_completed(batch, DEADLINE_S)).result()
    assert shed.status_code == 429, shed.text
    assert shed.headers["x-kubellm-drop-reason"] == "shed"
    assert not chat.done()  # waiting, not refused
    f.engine.behaviour.waiting = 0
    answer = chat.result(DEADLINE_S)
    assert answer.status_code == 200, answer.text
    assert f.dropped("eval-a", "shed") == 1


def test_one_tenant_cannot_hold_its_bands_whole_queue(fleet):
    f = fleet("--max-band-queue", "2")
    refused, *hog = fill(f, "eval-a", 2)  # eval-a fills its band's queue
    assert refused.result().status_code == 429
    other = f.later("eval-b")  # the same band: eval-a gives one place up
    shed = next(concurrent.futures.as_completed(hog, DEADLINE_S)).result()
    assert shed.status_code == 429 and shed.headers["x-kubellm-drop-reason"] == "shed"
    assert not other.done()
    f.engine.behaviour.waiting = 0
    assert other.result(DEADLINE_S).status_code == 200
