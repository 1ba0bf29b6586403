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
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf

    from . import handlers

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    registry = kopf.OperatorRegistry()
    handlers.register(registry, resync_seconds=args.resync_seconds)
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
