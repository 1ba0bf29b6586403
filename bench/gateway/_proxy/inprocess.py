"""`--in-process`: the gateway's own CPU per request, without its server sockets."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from bench import _fleet
from bench.gateway._proxy import load
from bench.gateway._proxy.paths import BACKEND, wait_port

free_port, pinned = _fleet.free_port, _fleet.pinned


async def in_process(requests: int, backend_url: str) -> dict:
    """The gateway's own CPU per request, without the gateway's server sockets.

    The gateway app is called through httpx's ASGI transport one request at a
    time; its upstream is the raw backend (another process, over loopback, with
    the gateway's real upstream client). The same client calls a bare ASGI app
    too; this process's CPU time per request, gateway minus bare, is the
    gateway's work (parsing, routing, the upstream request, metrics).
    """
    import httpx
    from kubellm.gateway.discovery.base import Endpoint, FixedDiscovery, ModelTarget
    from kubellm.gateway.http.app import Gateway, create_app

    completion = b'{"id":"c","object":"chat.completion","model":"m","choices":[]}'

    async def bare(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": completion})

    async def per_request(app) -> float:  # type: ignore[no-untyped-def]
        body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://g") as client:
            for _ in range(100):
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            start = time.process_time()
            for _ in range(requests):
                await client.post("/v1/chat/completions", json=body)
            return (time.process_time() - start) / requests * 1000

    targets = {"m": ModelTarget("m", "m", endpoints=(Endpoint(backend_url),))}
    gateway = Gateway(FixedDiscovery(targets))
    try:
        gateway_ms = await per_request(create_app(gateway))
    finally:
        await gateway.stop()
    bare_ms = await per_request(bare)
    own = gateway_ms - bare_ms
    return {"gateway_ms": gateway_ms, "bare_ms": bare_ms, "gateway_cpu_ms": own,
            "ceiling_rps_per_core": 1000 / own}  # fmt: skip


def in_process_mode(args: argparse.Namespace) -> dict:
    os.sched_setaffinity(0, {args.gateway_core})
    port = free_port()
    backend = subprocess.Popen(
        [sys.executable, str(BACKEND), str(port)], preexec_fn=pinned(args.load_core)
    )
    try:
        wait_port(port, backend)
        return load.run_loop(in_process(args.requests, f"http://127.0.0.1:{port}"))
    finally:
        backend.send_signal(signal.SIGINT)
        backend.wait(10)
