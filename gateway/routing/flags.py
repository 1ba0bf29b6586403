"""The command-line flags of the routing core and of discovery, shared by both front ends
(`kubellm gateway`, `kubellm epp`); their defaults are `settings.SchedulerSettings`'s.
Light to import: the CLI builds its parsers before any component loads."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from kubellm.gateway.routing.flow import flags as tenant_flags
from kubellm.gateway.routing.settings import SchedulerSettings, Thresholds

if TYPE_CHECKING:
    from kubellm.gateway.discovery.base import Discovery

_CORE = SchedulerSettings()
_SATURATED = Thresholds()


def add_discovery_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the models come from: a static file, or the cluster (`discovery(args)`)."""
    parser.add_argument(
        "--static",
        metavar="FILE",
        help="serve the models listed in FILE instead of watching the cluster",
    )
    parser.add_argument(
        "--namespace",
        help="watch only this namespace (cluster mode; default: all namespaces)",
    )


def discovery(
    args: argparse.Namespace,
    on_reload_error: Callable[[], None] | None = None,
    read_fallback_keys: bool = True,
) -> Discovery:
    """The discovery source the flags of `add_discovery_arguments` name. Raises
    `StaticConfigError` or OSError for a bad static file."""
    if args.static:
        from kubellm.gateway.discovery.static import StaticDiscovery

        return StaticDiscovery(args.static, on_reload_error=on_reload_error)
    from kubellm.gateway.discovery.kubernetes import KubernetesDiscovery

    from kubellm import kube

    return KubernetesDiscovery(
        kube.load(), namespace=args.namespace, read_fallback_keys=read_fallback_keys
    )


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The admission and routing flags both front ends take (`kubellm gateway`, `kubellm
    epp`), then the discovery flags; `settings_from(args)` turns the first into
    `SchedulerSettings`."""
    parser.add_argument(
        "--max-queue", type=int, default=_CORE.max_queue, help="waiting requests per model"
    )
    parser.add_argument(
        "--front-ends",
        type=_at_least_one,
        default=_CORE.front_ends,
        metavar="N",
        help="gateway (or picker) replicas sharing each model's traffic; over 1, a prompt "
        "this one knows no holder of is presumed held at its home (the chart sets it)",
    )
    parser.add_argument(
        "--zero-replica-wait",
        type=float,
        default=_CORE.zero_replica_wait_seconds,
        help="seconds a request may wait for a model with no ready replica (scale from zero)",
    )
    parser.add_argument(
        "--max-waiting",
        type=float,
        default=_SATURATED.max_waiting,
        help="engine queue depth at which a replica counts as saturated (default: the "
        "autoscaler's default targetQueueDepth, so overflow reaches the fallback before the "
        "queue asks for a replica; docs/autoscaling.md)",
    )
    parser.add_argument(
        "--max-kv-usage",
        type=float,
        default=_SATURATED.max_kv_usage,
        help="KV-cache usage at which a replica counts as saturated",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=_SATURATED.max_in_flight,
        help="requests per replica at which it counts as saturated (default: no cap)",
    )
    parser.add_argument(
        "--retry-after",
        type=int,
        default=_CORE.retry_after_seconds,
        help="the Retry-After (seconds) of a 429 (saturated) or 503 (no replica) answer",
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=_CORE.scrape_interval,
        help="seconds between engine scrapes",
    )
    parser.add_argument(
        "--adapter-routing",
        choices=("affinity", "blind"),
        default="affinity" if _CORE.adapter_affinity else "blind",
        help="LoRA requests: prefer replicas with the adapter in a slot (affinity), or route "
        "them by the policy alone (blind: to measure what affinity buys)",
    )
    parser.add_argument(
        "--max-adapter-loads",
        type=int,
        default=_CORE.max_adapter_loads,
        help="LoRA adapter loads (vLLM's runtime adapter API) running at once per replica",
    )
    parser.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=PATH",
        help="the tokenizer of a model routed with spec.routing.prefixIndex precise (a "
        "directory or a Hugging Face id it can read; `simulator` for simulated engines); "
        "repeat per model. Default: an hf:// model's own repository and revision; "
        "without one, precise mode scores approximately "
        "(kubellm_gateway_prefix_index_fallbacks_total)",
    )
    tenant_flags.add_arguments(parser)
    add_discovery_arguments(parser)


def settings_from(args: argparse.Namespace) -> SchedulerSettings:
    """`SchedulerSettings` from the flags of `add_arguments` (the rest keep their defaults)."""
    from kubellm.gateway.routing.index.precise_routing import tokenizer_pairs

    return SchedulerSettings(
        front_ends=args.front_ends,
        thresholds=Thresholds(args.max_waiting, args.max_kv_usage, args.max_in_flight),
        max_queue=args.max_queue,
        zero_replica_wait_seconds=args.zero_replica_wait,
        retry_after_seconds=args.retry_after,
        scrape_interval=args.scrape_interval,
        tokenizers=tokenizer_pairs(args.tokenizer),
        adapter_affinity=args.adapter_routing == "affinity",
        max_adapter_loads=args.max_adapter_loads,
        tenancy=tenant_flags.settings_from(args),
    )
