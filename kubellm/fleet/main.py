"""The running local fleet: supervisor, gateway and autoscaler in one asyncio loop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from kubellm.autoscaler.loop import Autoscaler
from kubellm.fleet import status as fleet_status
from kubellm.fleet.processes import Supervisor
from kubellm.fleet.runtime import LocalBackend, LocalRuntime
from kubellm.gateway.cli import tune_gc
from kubellm.gateway.discovery.base import FixedDiscovery
from kubellm.gateway.http import server as gateway_server
from kubellm.gateway.http.app import Gateway, GatewaySettings, create_app
from kubellm.gateway.routing.settings import SchedulerSettings

STATE_FILE = "fleet.json"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the fleet owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


async def _every(seconds: float, stop: asyncio.Event, work: Any) -> None:
    while not stop.is_set():
        await work()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=seconds)


def _mtimes(paths: list[str]) -> dict[str, float]:
    out = {}
    for path in paths:
        with contextlib.suppress(OSError):
            out[path] = os.stat(path).st_mtime
    return out


async def serve(args: argparse.Namespace, deployments: list) -> int:
    from kubellm import manifests
    from kubellm.fleet.up import load_manifests

    run_dir = Path(args.run_dir).resolve()
    supervisor = Supervisor(run_dir / "logs")
    runtime = LocalRuntime(
        supervisor,
        run_dir,
        engine=args.engine,
        sim_time_scale=args.sim_time_scale,
        sim_profile=args.sim_profile,
        sim_slowdown=args.sim_slowdown,
    )
    for change in runtime.apply(deployments):
        print(f"kubellm up: {change}", flush=True)

    discovery = FixedDiscovery()
    # precise deployments: the gateway hashes prompts as their engines do (runtime.tokenizers)
    core = SchedulerSettings(tokenizers=runtime.tokenizers())
    gateway = Gateway(discovery, GatewaySettings(scheduler=core))
    limits = gateway_server.ClientLimits()  # the same client bounds as `kubellm gateway`
    server = _Server(
        gateway_server.config(
            create_app(gateway),
            limits,
            gateway.metrics.connections_refused.inc,
            host=args.host,
            port=args.port,
            log_level="warning",
        )
    )
    tune_gc()  # as `kubellm gateway` does: this process serves the fleet's gateway
    gateway_url = f"http://{args.host}:{args.port}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    published: dict[str, Any] = {}

    async def tend() -> None:
        await supervisor.reconcile()
        targets = runtime.gateway_targets()
        if targets != published:
            published.clear()
            published.update(targets)
            discovery.update(targets)
        _write_state(run_dir, gateway_url, runtime)

    mtimes = _mtimes(args.filename)

    async def watch() -> None:
        nonlocal mtimes
        now = _mtimes(args.filename)
        if now == mtimes:
            return
        mtimes = now
        try:
            changes = runtime.apply(load_manifests(args.filename))
        except manifests.ManifestError as error:
            print(f"kubellm up: not applied: {error}", file=sys.stderr, flush=True)
            return
        for change in changes:
            print(f"kubellm up: {change}", flush=True)
        gateway.scheduler.precise.tokenizer_paths.update(runtime.tokenizers())

    http = httpx.AsyncClient(timeout=2.0)

    async def show() -> None:
        rows = await _rows(http, gateway_url, runtime)
        print(fleet_status.format_table(rows), flush=True)
        adapters = fleet_status.format_adapters(rows)
        if adapters:
            print(adapters, flush=True)
        for line in _starting(runtime, args.engine):
            print(f"kubellm up: {line}", flush=True)

    async def rollouts() -> None:
        """Canary rollouts (spec.rollout.strategy Canary), analysed on this gateway's own
        per-revision figures, as the operator analyses a cluster's."""
        from prometheus_client import generate_latest

        from kubellm.operator import figures

        text = generate_latest(gateway.metrics.registry).decode()
        counters = {
            d.manifest.served_name: figures.parse(text, d.manifest.served_name)
            for d in runtime.deployments.values()
        }
        runtime.tend_rollout(counters, time.time())  # its events print with the supervisor's

    printed_events = 0

    async def events() -> None:
        nonlocal printed_events
        for line in supervisor.events_since(printed_events):
            print(f"kubellm up: {line}", flush=True)
        printed_events = supervisor.events_total

    autoscaler = Autoscaler(
        LocalBackend(runtime),
        http,
        gateway_metrics_url=f"{gateway_url}/metrics",
        period=args.autoscale_period,
    )
    server_task = asyncio.create_task(server.serve())
    while not server.started and not server_task.done():
        await asyncio.sleep(0.05)  # uvicorn exposes no started event; poll its flag
    if server_task.done():
        await supervisor.stop_all()
        print(f"kubellm up: the gateway could not listen on {gateway_url}", file=sys.stderr)
        return 1
    print(
        f"kubellm up: gateway at {gateway_url}/v1 (metrics at {gateway_url}/metrics); "
        f"engines: {args.engine}; logs in {run_dir / 'logs'}; Ctrl-C stops",
        flush=True,
    )
    tasks = [
        asyncio.create_task(_every(0.5, stop, tend)),
        asyncio.create_task(_every(0.5, stop, events)),
        asyncio.create_task(_every(args.rollout_seconds, stop, rollouts)),
        asyncio.create_task(autoscaler.run(stop)),
    ]
    if args.watch:
        tasks.append(asyncio.create_task(_every(1.0, stop, watch)))
    if args.status_interval > 0:
        tasks.append(asyncio.create_task(_every(args.status_interval, stop, show)))
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await events()  # what happened since the last print, before the stop lines
        print("kubellm up: stopping", flush=True)
        server.should_exit = True
        await supervisor.stop_all()
        await asyncio.gather(server_task, return_exceptions=True)
        await http.aclose()
        with contextlib.suppress(OSError):
            (run_dir / STATE_FILE).unlink()
        print("kubellm up: stopped", flush=True)
    return 0


async def _rows(
    http: httpx.AsyncClient, gateway_url: str, runtime: LocalRuntime
) -> list[fleet_status.ModelRow]:
    async def text(url: str) -> str:
        try:
            response = await http.get(url)
            return response.text if response.status_code == 200 else ""
        except httpx.HTTPError:
            return ""

    gateway_text = await text(f"{gateway_url}/metrics")
    rows = []
    for name, deployment in runtime.deployments.items():
        replicas = runtime.supervisor.endpoints(name)
        ready = [r for r in replicas if r.state == "ready"]
        engine_texts = await asyncio.gather(*(text(f"{r.url}/metrics") for r in ready))
        row = fleet_status.model_row(
            deployment.manifest.served_name,
            gateway_text,
            list(engine_texts),
            ready=len(ready),
            desired=runtime.desired_replicas(name),
        )
        row.adapters = deployment.adapter_status  # status.adapters, by the autoscaler
        rows.append(row)
    return rows


def _starting(runtime: LocalRuntime, engine: str) -> list[str]:
    """A line per replica still starting: for how long, what it does, where its output goes."""
    from kubellm.progress import elapsed

    what = (
        "vLLM loads the model and warms up; the first start takes a minute or two on CPUs"
        if engine == "vllm"
        else "the simulator starts"
    )
    now = time.monotonic()
    return [
        f"{r.name} starting for {elapsed(now - r.started)} ({what}); its output: {r.log_path}"
        for name in runtime.deployments
        for r in runtime.supervisor.endpoints(name)
        if r.state == "starting"
    ]


def _write_state(run_dir: Path, gateway_url: str, runtime: LocalRuntime) -> None:
    """Where `kubellm status` finds a running fleet."""
    state = {
        "pid": os.getpid(),
        "gateway": gateway_url,
        "updated": time.time(),
        "deployments": {
            name: {
                "model": d.manifest.served_name,
                # kubellm diagnose words its advice for this spec
                "spec": d.manifest.spec.model_dump(by_alias=True, exclude_none=True, mode="json"),
                "desired": runtime.desired_replicas(name),
                "replicas": [
                    {
                        "name": r.name,
                        "url": r.url,
                        "state": r.state,
                        "restarts": r.restarts,
                        "pid": r.process.pid if r.process else None,
                        **({"kvEventsPort": r.kv_events_port} if r.kv_events_port else {}),
                    }
                    for r in runtime.supervisor.endpoints(name)
                ],
                "autoscaler": d.autoscaler_status,
                "adapters": d.adapter_status,
                "rollout": d.rollout_status,
                "canaryReplicas": [
                    {"name": r.name, "url": r.url, "state": r.state}
                    for r in runtime.supervisor.endpoints(d.canary_key)
                ],
                "prefillReplicas": [
                    {
                        "name": r.name,
                        "url": r.url,
                        "state": r.state,
                        "pid": r.process.pid if r.process else None,
                    }
                    for r in runtime.supervisor.endpoints(d.prefill_key)
                ],
            }
            for name, d in runtime.deployments.items()
        },
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(run_dir / STATE_FILE)
