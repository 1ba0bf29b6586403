"""Flow control's drops through a real `kubellm epp --tenants` process (issue 39, item 1):
a request flow control drops is answered to Envoy as a 429 with `Retry-After` and
`x-kubellm-drop-reason` (an immediate response Envoy sends the client), not a 500, and is
counted per tenant. A raw gRPC client speaks ext_proc to it; the replica is a fake engine
on loopback that reports a deep queue, so requests wait at the picker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubellm.gateway.epp import messages as m
from kubellm.gateway.routing.flow import tenants

from tests.fixtures.engines import free_port, wait_until
from tests.fixtures.servers import ServerThread
from tests.gateway.epp.conftest import START_TIMEOUT_S, Process, responds
from tests.gateway.epp.test_faults import HttpHeaders, body, channel, stream
from tests.gateway.upstream import FakeEngine

ANSWER_TIMEOUT_S = 60.0


@pytest.fixture
def picker(tmp_path: Path) -> Iterator[tuple[str, str, FakeEngine]]:
    engine = FakeEngine("e0")
    engine.behaviour.waiting = 50  # saturated: requests wait at the picker
    server = ServerThread(engine.app()).start()
    static = tmp_path / "models.yaml"
    static.write_text(yaml.safe_dump({"models": [
        {"name": "tiny", "endpoints": [server.url], "slo": {"ttftSeconds": 60}},
    ]}))  # fmt: skip
    declared = tmp_path / "tenants.yaml"
    declared.write_text(yaml.safe_dump({"tenants": [
        {"name": "eval", "priority": -1, "apiKeys": [f"sha256:{tenants.digest('sk-eval')}"]},
    ]}))  # fmt: skip
    grpc_port, metrics_port = free_port(), free_port()
    process = Process("epp", [
        sys.executable, "-m", "kubellm.cli", "epp", "--static", str(static),
        "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port", "0",
        "--metrics-port", str(metrics_port), "--scrape-interval", "0.2",
        "--tenants", str(declared), "--max-band-queue", "1", "--band-ttl", "60",
    ], tmp_path / "epp.log").start()  # fmt: skip
    health = f"http://127.0.0.1:{metrics_port}/health"
    try:
        wait_until(
            lambda: not process.alive() or responds(health), START_TIMEOUT_S, "the EPP to serve"
        )
        assert process.alive(), process.tail()
        yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{metrics_port}/metrics", engine
    finally:
        engine.behaviour.waiting = 0
        with contextlib.suppress(OSError):
            process.stop()
        server.stop()


def request_headers() -> Any:
    values = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json",
              "authorization": "Bearer sk-eval"}  # fmt: skip
    return m.ProcessingRequest(
        request_headers=HttpHeaders(
            headers={"headers": [{"key": k, "raw_value": v.encode()} for k, v in values.items()]}
        ),
        protocol_config={"request_body_mode": m.FULL_DUPLEX, "response_body_mode": m.FULL_DUPLEX},
    )


async def test_a_band_full_drop_is_a_429_with_its_reason_for_envoy(picker):
    address, metrics_url, engine = picker
    payload = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4}).encode()
    async with channel(address) as open_channel:
        calls = [stream(open_channel) for _ in range(2)]  # the band holds one: one is dropped
        for call in calls:
            await call.write(request_headers())
            await call.write(body(payload, end=True))
        reads = {asyncio.ensure_future(call.read()): call for call in calls}
        done, _ = await asyncio.wait(
            reads, timeout=ANSWER_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        assert done, "no answer"
        answer = next(iter(done)).result()
        assert answer.WhichOneof("response") == "immediate_response", answer
        immediate = answer.immediate_response
        sent = {h.header.key.lower(): h.header.raw_value.decode()
                for h in immediate.headers.set_headers}  # fmt: skip
        assert immediate.status.code == 429, immediate.body
        assert sent["x-kubellm-drop-reason"] == "band-full"
        assert int(sent["retry-after"]) >= 1
        assert json.loads(immediate.body)["error"]["type"] == "rate_limit_error"
        text = httpx.get(metrics_url, timeout=10).text
        assert 'kubellm_gateway_tenant_dropped_total{reason="band-full",tenant="eval"} 1.0' in text
        engine.behaviour.waiting = 0  # the other one is routed now
        for future in reads:
            if future not in done:
                routed = await asyncio.wait_for(future, ANSWER_TIMEOUT_S)
                assert routed.WhichOneof("response") != "immediate_response", routed
        for call in calls:
            call.cancel()
