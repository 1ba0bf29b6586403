"""`kubellm operator`: run the kopf operator that reconciles LLMDeployments."""

from __future__ import annotations

import argparse
import json
from typing import Any

from . import builders


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
    picker = parser.add_argument_group(
        "endpoint pickers", "the picker the operator runs for each InferencePool whose spec "
        "names none (spec.routing.inferencePool.endpointPicker.name unset)"
    )  # fmt: skip
    picker.add_argument(
        "--shared-endpoint-picker",
        metavar="SERVICE",
        default=None,
        help="point such pools at this shared picker Service (in the pool's namespace) and run "
        "none per pool; default: one `kubellm epp --pool-name` per pool",
    )
    picker.add_argument(
        "--epp-image",
        default=builders.PickerOptions.image,
        help=f"the per-pool pickers' image (default: {builders.PickerOptions.image})",
    )
    picker.add_argument(
        "--epp-image-pull-policy",
        choices=("Always", "IfNotPresent", "Never"),
        default=builders.PickerOptions.image_pull_policy,
    )
    picker.add_argument(
        "--epp-fallback-forwarder",
        metavar="HOST:PORT",
        default=None,
        help="the per-pool pickers' --fallback-forwarder (the chart's gateway Service)",
    )
    picker.add_argument(
        "--epp-quota-redis",
        metavar="URL",
        default=None,
        help="the per-pool pickers' --quota-redis where the pool's spec names a tenants Secret "
        "(endpointPicker.tenantsSecretRef), so their quotas and the gateway's are counted "
        "once (the chart passes gateway.quotaRedis); default: each picker counts alone",
    )
    picker.add_argument(
        "--epp-resources",
        metavar="JSON",
        type=_resources,
        default=None,
        help='the per-pool pickers\' container resources, e.g. \'{"requests": {"cpu": "250m"}}\' '
        "(default: 250m CPU and 256Mi requested, 1Gi memory limit)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _resources(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if (
        not isinstance(parsed, dict)
        or not set(parsed) <= {"requests", "limits"}
        or not all(isinstance(v, dict) for v in parsed.values())
    ):
        raise argparse.ArgumentTypeError('expected {"requests": {...}, "limits": {...}}')
    return parsed


def picker_options(args: argparse.Namespace) -> builders.PickerOptions:
    """The per-pool pickers' settings from the command line."""
    resources = args.epp_resources
    return builders.PickerOptions(
        shared=args.shared_endpoint_picker,
        image=args.epp_image,
        image_pull_policy=args.epp_image_pull_policy,
        fallback_forwarder=args.epp_fallback_forwarder,
        quota_redis=args.epp_quota_redis,
        **({"resources": resources} if resources is not None else {}),
    )


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
        picker=picker_options(args),
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
