"""Proxy cost: the latency the gateway adds and the request rate it sustains.

A near-zero-latency OpenAI-compatible backend (a raw ASGI app answering a fixed
completion, or a short SSE stream) runs under uvicorn in its own process; the
gateway (`python -m kubellm.gateway.cli --static ...`) in another. The load
generator (this process, httpx) runs the same closed-loop load against the
backend directly and through the gateway, in the same run, and prints
p50/p99 latency, the added latency and requests/s, and the ratios.

    python bench/gateway_proxy.py                      # 100 concurrent, 3,000 requests
    python bench/gateway_proxy.py --concurrency 100 --requests 5000
    python bench/gateway_proxy.py --in-process         # the gateway's own CPU per request

Note: the load generator shares the machine's cores with both servers, so the
request rate is a lower bound for the gateway alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

BACKEND = r"""
import json, sys, uvicorn
COMPLETION = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",' \
        b'"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] in ("/health", "/metrics"):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    if b'"stream": true' in body or b'"stream":true' in body:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(8):
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": COMPLETION})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not start")


async def load(url: str, stream: bool, concurrency: int, total: int) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    latencies: list[float] = []
    errors = 0
    remaining = total
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def worker() -> None:
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                start = time.perf_counter()
                try:
                    if stream:
                        async with client.stream(
                            "POST", f"{url}/v1/chat/completions", json=body
                        ) as response:
                            async for _ in response.aiter_raw():
                                pass
                    else:
                        response = await client.post(f"{url}/v1/chat/completions", json=body)
                    if response.status_code != 200:
                        errors += 1
                except httpx.HTTPError:
                    errors += 1
                latencies.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "rps": len(latencies) / wall,
        "errors": errors,
    }


async def in_process(requests: int) -> dict:
    """The gateway's own CPU per request: no sockets, a mock upstream, one request at a time.

    Same client, same ASGI transport, once through the gateway app (upstream:
    httpx.MockTransport) and once to a bare ASGI app; the difference is the
    gateway's work (parsing, routing, proxying, metrics).
    """
    from kubellm.gateway.app import Gateway, create_app
    from kubellm.gateway.discovery.base import Endpoint, FixedDiscovery, ModelTarget

    completion = json.dumps({"id": "c", "object": "chat.completion", "model": "m",
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "ok"}}],
                             "usage": {"completion_tokens": 1}}).encode()  # fmt: skip

    def upstream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=completion, headers={"content-type": "application/json"})

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
                await client.post("/v1/chat/completions", json=body)
            start = time.perf_counter()
            for _ in range(requests):
                await client.post("/v1/chat/completions", json=body)
            return (time.perf_counter() - start) / requests * 1000

    targets = {"m": ModelTarget("m", "m", endpoints=(Endpoint("http://b1"), Endpoint("http://b2")))}
    mock = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    gateway_ms = await per_request(create_app(Gateway(FixedDiscovery(targets), client=mock)))
    bare_ms = await per_request(bare)
    own = gateway_ms - bare_ms
    return {"gateway_ms": gateway_ms, "bare_ms": bare_ms, "gateway_cpu_ms": own,
            "ceiling_rps_per_core": 1000 / own}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=100)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--in-process", action="store_true", help="only the in-process CPU figure")
    p.add_argument("--out", default="bench/results/gateway_proxy.json")
    args = p.parse_args(argv)
    if args.in_process:
        r = asyncio.run(in_process(args.requests))
        print(f"in-process: gateway {r['gateway_ms']:.3f} ms/request, bare app "
              f"{r['bare_ms']:.3f} ms; the gateway's own CPU {r['gateway_cpu_ms']:.3f} ms/request "
              f"-> ceiling ~{r['ceiling_rps_per_core']:.0f} req/s per core")  # fmt: skip
        return 0
    processes = []
    tmp = tempfile.TemporaryDirectory()
    try:
        backend_port, gateway_port = free_port(), free_port()
        script = Path(tmp.name) / "backend.py"
        script.write_text(BACKEND)
        processes.append(subprocess.Popen([sys.executable, str(script), str(backend_port)]))
        backend = f"http://127.0.0.1:{backend_port}"
        wait_healthy(backend)
        static = Path(tmp.name) / "static.yaml"
        static.write_text(yaml.safe_dump({"models": [{"name": "m", "endpoints": [backend]}]}))
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kubellm.gateway.cli",
                    "--port",
                    str(gateway_port),
                    "--static",
                    str(static),
                ]
            )
        )
        gateway = f"http://127.0.0.1:{gateway_port}"
        wait_healthy(gateway)
        rows = []
        print(f"{'mode':10} {'path':8} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'errors':>6}")
        for stream in (False, True):
            mode = "stream" if stream else "json"
            asyncio.run(load(backend, stream, args.concurrency, 200))  # warm up both
            asyncio.run(load(gateway, stream, args.concurrency, 200))
            direct = asyncio.run(load(backend, stream, args.concurrency, args.requests))
            proxied = asyncio.run(load(gateway, stream, args.concurrency, args.requests))
            for path, r in (("direct", direct), ("gateway", proxied)):
                print(f"{mode:10} {path:8} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                      f"{r['rps']:>8.0f} {r['errors']:>6}")  # fmt: skip
            added = {
                "mode": mode, "concurrency": args.concurrency,
                "direct": direct, "gateway": proxied,
                "added_p50_ms": proxied["p50_ms"] - direct["p50_ms"],
                "added_p99_ms": proxied["p99_ms"] - direct["p99_ms"],
                "rps_ratio": proxied["rps"] / direct["rps"],
            }  # fmt: skip
            print(f"{mode:10} added    {added['added_p50_ms']:>8.2f} {added['added_p99_ms']:>8.2f} "
                  f"{added['rps_ratio']:>7.0%}")  # fmt: skip
            rows.append(added)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=2))
        print(f"wrote {out}")
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
