"""The command-line flags of the routing core, shared by both front ends (`kubellm gateway`,
`kubellm epp`). Light to import: the CLI builds its parsers before any component loads."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kubellm.gateway.routing import tenant_flags

if TYPE_CHECKING:
    from kubellm.gateway.routing.scheduler import SchedulerSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The admission and routing flags both front ends take (`kubellm gateway`, `kubellm
    epp`); `settings_from(args)` turns them into `SchedulerSettings`."""
    parser.add_argument("--max-queue", type=int, default=256, help="waiting requests per model")
    parser.add_argument(
        "--zero-replica-wait",
        type=float,
        default=60.0,
        help="seconds a request may wait for a model with no ready replica (scale from zero)",
    )
    parser.add_argument(
        "--max-waiting",
        type=float,
        default=4.0,
        help="engine queue depth at which a replica counts as saturated (default: the "
        "autoscaler's default targetQueueDepth, so overflow reaches the fallback before the "
        "queue asks for a replica; docs/autoscaling.md)",
    )
    parser.add_argument(
        "--max-kv-usage",
        type=float,
        default=0.95,
        help="KV-cache usage at which a replica counts as saturated",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="requests per replica at which it counts as saturated (default: no cap)",
    )
    parser.add_argument(
        "--scrape-interval", type=float, default=1.0, help="seconds between engine scrapes"
    )
    parser.add_argument(
        "--adapter-routing",
        choices=("affinity", "blind"),
        default="affinity",
        help="LoRA requests: prefer replicas with the adapter in a slot (affinity), or route "
        "them by the policy alone (blind: to measure what affinity buys)",
    )
    parser.add_argument(
        "--max-adapter-loads",
        type=int,
        default=2,
        help="LoRA adapter loads (vLLM's runtime adapter API) running at once",
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


def settings_from(args: argparse.Namespace) -> SchedulerSettings:
    """`SchedulerSettings` from the flags of `add_arguments` (the rest keep their defaults)."""
    from kubellm.gateway.routing.admission import Thresholds
    from kubellm.gateway.routing.precise import tokenizer_pairs
    from kubellm.gateway.routing.scheduler import SchedulerSettings

    return SchedulerSettings(
        thresholds=Thresholds(args.max_waiting, args.max_kv_usage, args.max_in_flight),
        max_queue=args.max_queue,
        zero_replica_wait_seconds=args.zero_replica_wait,
        scrape_interval=args.scrape_interval,
        tokenizers=tokenizer_pairs(args.tokenizer),
        adapter_affinity=args.adapter_routing == "affinity",
        max_adapter_loads=args.max_adapter_loads,
        tenancy=tenant_flags.settings_from(args),
    )
