"""`kubellm autoscaler`: run the control loop against the Kubernetes API.

Imports stay light here; the loop, httpx and uvicorn load inside `run`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

    from kubellm.autoscaler.policy import Policy


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway-metrics-url",
        metavar="URL",
        help="the gateway's /metrics, for pending requests (needed to wake up from zero)",
    )
    parser.add_argument(
        "--namespace", help="only this namespace (default: all namespaces the account can list)"
    )
    parser.add_argument(
        "--period", type=float, default=5.0, help="seconds between decisions (default: 5)"
    )
    parser.add_argument("--policy", default="kv-queue", help="scaling policy (default: kv-queue)")
    parser.add_argument(
        "--scrape-timeout", type=float, default=2.0, help="seconds per /metrics scrape"
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster or KUBECONFIG)")
    parser.add_argument("--context", help="kubeconfig context")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="port of the autoscaler's own /metrics and /healthz (0: off)",
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address to serve /metrics on")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import sys

    from kubellm.autoscaler import policy

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.period <= 0:
        print("kubellm autoscaler: --period must be positive", file=sys.stderr)
        return 2
    try:
        chosen = policy.get(args.policy)
    except ValueError as error:
        print(f"kubellm autoscaler: --policy: {error}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(args, chosen))
    except KeyboardInterrupt:
        return 0


async def serve(args: argparse.Namespace, chosen: Policy, stop: asyncio.Event | None = None) -> int:
    """Run until SIGINT/SIGTERM (or until `stop` is set, for tests)."""
    import asyncio
    import contextlib
    import signal

    import httpx
    from kubellm.autoscaler.kube_backend import KubernetesBackend
    from kubellm.autoscaler.loop import Autoscaler
    from kubellm.autoscaler.telemetry import Telemetry, serve

    from kubellm import kube

    if args.kubeconfig or args.context:
        config = kube.from_kubeconfig(args.kubeconfig, args.context)
    else:
        config = kube.load()
    telemetry = Telemetry()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM) if stop is None else ()
    stop = stop or asyncio.Event()
    for sig in signals:
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)

    try:
        async with (
            kube.async_client(config) as api_client,
            httpx.AsyncClient(timeout=args.scrape_timeout) as scrape_client,
        ):
            scaler = Autoscaler(
                KubernetesBackend(api_client, args.namespace),
                scrape_client,
                policy=chosen,
                gateway_metrics_url=args.gateway_metrics_url,
                telemetry=telemetry,
                period=args.period,
            )
            tasks = [asyncio.create_task(scaler.run(stop))]
            if args.metrics_port:
                tasks.append(
                    asyncio.create_task(
                        serve(telemetry, args.metrics_host, args.metrics_port, stop)
                    )
                )
            await asyncio.gather(*tasks)
    finally:
        for sig in signals:
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)
    return 0
