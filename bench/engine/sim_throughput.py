"""How much simulated traffic one core pushes through the simulated engine.

Two figures:
1. core: 8 simulated replicas (llama-3.1-8b-h100 profile) fed a Poisson trace
   of 200 requests/s for 60 simulated seconds (prompts of ~512 tokens sharing
   a few prefixes, 128 output tokens), stepped in virtual time: wall seconds
   for the whole trace, and simulated requests per wall second.
2. HTTP in-process: one simulator app (time scale 0) driven through
   httpx.ASGITransport by 32 concurrent non-streaming clients: requests per
   wall second through the real OpenAI endpoint, no sockets.
3. HTTP over loopback: `kubellm engine --backend sim` in its own process,
   64 httpx clients here (the client costs as much as the server).

    .venv/bin/python -m bench.sim_throughput
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import random
import time

from kubellm.engine import sim_profiles
from kubellm.engine.sim_core import Engine, Request

REPLICAS = 8
RATE = 200.0
TRACE_S = 60.0
OUTPUT_TOKENS = 128


def trace(seed: int = 0) -> list[tuple[float, list[int]]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(384)] for _ in range(16)]
    now, out = 0.0, []
    while True:
        now += rng.expovariate(RATE)
        if now >= TRACE_S:
            return out
        suffix = [rng.randrange(50_000) for _ in range(rng.randrange(64, 192))]
        out.append((now, prefixes[rng.randrange(len(prefixes))] + suffix))


def run_core() -> dict[str, float]:
    """Discrete-event simulation of REPLICAS engines in virtual time."""
    profile = sim_profiles.get("llama-3.1-8b-h100")
    engines = [Engine(profile) for _ in range(REPLICAS)]
    arrivals = trace()
    started = time.perf_counter()
    clock = [0.0] * REPLICAS  # when each replica's current step ends
    events: list[tuple[float, int]] = []  # (time, replica) of step ends
    finished = 0
    ttft: list[float] = []
    first_seen: dict[str, float] = {}
    arrival_of: dict[str, float] = {}
    next_arrival = 0
    now = 0.0
    while next_arrival < len(arrivals) or events or any(e.has_work for e in engines):
        upcoming = arrivals[next_arrival][0] if next_arrival < len(arrivals) else float("inf")
        if events and events[0][0] <= upcoming:
            now, replica = heapq.heappop(events)
        elif upcoming < float("inf"):
            now, prompt = arrivals[next_arrival]
            replica = next_arrival % REPLICAS  # round-robin
            request_id = f"r{next_arrival}"
            arrival_of[request_id] = now
            engines[replica].add(Request(request_id, prompt, OUTPUT_TOKENS))
            next_arrival += 1
            if clock[replica] > now:  # busy: its step-end event will pick it up
                continue
        else:
            break
        engine = engines[replica]
        if not engine.has_work:
            continue
        result = engine.step()
        end = now + result.duration
        for request, _ in result.tokens:
            if request.request_id not in first_seen:
                first_seen[request.request_id] = end
                ttft.append(end - arrival_of[request.request_id])
        finished += len(result.finished)
        clock[replica] = end
        heapq.heappush(events, (end, replica))
    wall = time.perf_counter() - started
    ttft.sort()
    return {
        "requests": len(arrivals),
        "finished": finished,
        "simulated_s": now,
        "wall_s": wall,
        "sim_requests_per_wall_s": len(arrivals) / wall,
        "p50_ttft_s": ttft[len(ttft) // 2],
        "p99_ttft_s": ttft[int(len(ttft) * 0.99)],
        "hit_rate": sum(e.prefix_hits for e in engines) / sum(e.prefix_queries for e in engines),
    }


async def run_http(total: int = 1000, concurrency: int = 32) -> dict[str, float]:
    import httpx
    from kubellm.engine.sim import create_app

    app = create_app("bench", "llama-3.1-8b-h100", 0.0)
    transport = httpx.ASGITransport(app=app)
    body = {"model": "bench", "prompt": "shared system prompt " * 40, "max_tokens": 32}
    remaining = iter(range(total))
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:

        async def worker() -> None:
            for _ in remaining:
                (await client.post("/v1/completions", json=body)).raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {"requests": total, "wall_s": wall, "requests_per_wall_s": total / wall}


async def run_socket(total: int = 1000, concurrency: int = 64) -> dict[str, float]:
    import subprocess
    import sys

    import httpx

    from kubellm.fleet.processes import free_port

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "kubellm.engine", "--backend", "sim", "--port", str(port),
         "--served-model-name", "bench", "--time-scale", "0"],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    body = {"model": "bench", "prompt": "shared system prompt " * 40, "max_tokens": 32}
    remaining = iter(range(total))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            for _ in range(200):  # wait up to ~20 s for the server
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)

            async def worker() -> None:
                for _ in remaining:
                    (await client.post("/v1/completions", json=body)).raise_for_status()

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {"requests": total, "wall_s": wall, "requests_per_wall_s": total / wall}


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # no options: --help prints what it measures, and nothing runs
    core = run_core()
    print(f"simulator core: {REPLICAS} replicas, {RATE:g} req/s x {TRACE_S:g} s trace "
          f"({core['requests']:.0f} requests, {core['finished']:.0f} finished, "
          f"{core['simulated_s']:.1f} simulated s)")  # fmt: skip
    print(f"  wall {core['wall_s']:.2f} s on one core = {core['sim_requests_per_wall_s']:,.0f} "
          f"simulated requests per wall second; p50/p99 TTFT {core['p50_ttft_s'] * 1000:.0f}/"
          f"{core['p99_ttft_s'] * 1000:.0f} ms; prefix hit rate "
          f"{core['hit_rate']:.0%}")  # fmt: skip
    http = asyncio.run(run_http())
    print(f"simulator HTTP (in-process ASGI, time scale 0, 32 clients): "
          f"{http['requests_per_wall_s']:,.0f} requests per wall second")  # fmt: skip
    sock = asyncio.run(run_socket())
    print(f"simulator HTTP (separate process over loopback, 64 httpx clients): "
          f"{sock['requests_per_wall_s']:,.0f} requests per wall second")  # fmt: skip


if __name__ == "__main__":
    main()
