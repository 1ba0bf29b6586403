"""`kubellm operator`: run the kopf operator that reconciles LLMDeployments."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch only this namespace (repeatable; glob patterns allowed); default: all",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=60.0,
        help="reconcile every LLMDeployment at least this often (default: 60)",
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="coordinate several operator replicas through this kopf peering object "
        "(default: standalone)",
    )
    parser.add_argument(
        "--gateway-metrics-url",
        action="append",
        default=[],
        metavar="URL",
        help="a kubellm gateway's /metrics, read for the canary analysis' per-revision "
        "figures (repeatable: one per gateway replica, their counts add up); without it a "
        "canary step waits for `kubellm rollout promote`",
    )
    parser.add_argument(
        "--prometheus-url",
        metavar="URL",
        default=None,
        help="read the canary analysis' figures from this Prometheus (which scrapes every "
        "gateway replica: their counts are summed) instead of --gateway-metrics-url",
    )
    parser.add_argument(
        "--rollout-seconds",
        type=float,
        default=5.0,
        help="how often a canary rollout in progress is analysed (default: 5)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf

    from . import handlers
    from .figures import GatewayFigures, PrometheusFigures

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    registry = kopf.OperatorRegistry()
    urls = list(args.gateway_metrics_url)

    def figures() -> GatewayFigures | PrometheusFigures | None:
        if args.prometheus_url:
            return PrometheusFigures(args.prometheus_url)
        return GatewayFigures(urls) if urls else None

    handlers.register(
        registry,
        resync_seconds=args.resync_seconds,
        rollout_seconds=args.rollout_seconds,
        figures=figures,
    )
    asyncio.run(
        kopf.operator(
            registry=registry,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            standalone=args.peering is None,
            peering_name=args.peering,
            liveness_endpoint=args.liveness,
        )
    )
    return 0
