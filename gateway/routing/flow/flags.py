"""The tenancy flags of both front ends (`--tenants FILE` and its companions). Light to
import, like `flags.py`: the models load in `settings_from`."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kubellm.gateway.routing.settings import FlowSettings

if TYPE_CHECKING:
    from kubellm.gateway.routing.flow.controller import TenancySettings

_FLOW = FlowSettings()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "tenants: priorities, fair shares, quotas (docs/operations.md, 'Onboarding a tenant')"
    )
    group.add_argument(
        "--tenants",
        metavar="FILE",
        help="the declared tenants (YAML: name, apiKeys as sha256 digests, priority, weight, "
        "tokensPerMinute, requestsPerMinute, fallback); replaces --api-keys-file",
    )
    group.add_argument(
        "--quota-redis",
        metavar="URL",
        help="keep quota counts in this Redis (redis://host:6379/0), shared by every gateway "
        "replica naming it (default: in this process)",
    )
    group.add_argument(
        "--band-ttl",
        type=float,
        default=_FLOW.ttl_seconds,
        help="seconds a sheddable request (priority < 0) may wait for a replica",
    )
    group.add_argument(
        "--max-band-queue",
        type=int,
        default=_FLOW.max_band,
        help="requests waiting per priority band and model",
    )
    group.add_argument(
        "--headroom-load",
        type=float,
        default=_FLOW.headroom_load,
        help="sheddable requests dispatch only to replicas with fewer requests than this "
        "(keep it a few under maxNumSeqs, so high bands find a free slot; default: only the "
        "engine queue and KV usage bound them)",
    )
    group.add_argument(
        "--headroom-hold-prefill",
        action=argparse.BooleanOptionalAction,
        default=_FLOW.hold_prefill,
        help="while a stream of priority >= 0 awaits its first token on a replica, sheddable "
        "requests go to other replicas, so its prefill does not share engine steps with a "
        "long batch prompt (--no-headroom-hold-prefill: they may go there)",
    )
    group.add_argument(
        "--headroom-prefill-rate",
        default="auto",
        metavar="TOKENS_PER_S|auto|off",
        help="sheddable requests' prompt tokens a replica is sent per second at most, one "
        "request at a time, so several batch prompts never share one engine step with a "
        "chat prompt. auto (default): each replica's prefill speed, learnt from "
        "the prompt tokens it computed (vllm:prompt_tokens_by_source_total) and "
        "vllm:request_prefill_time_seconds, and only while a "
        "request of priority >= 0 came in the last 30 s (a batch tenant alone is not "
        "paced); off: no bound",
    )
    group.add_argument(
        "--fair-in-flight-tokens",
        default="auto",
        metavar="TOKENS|auto|off",
        help="service tokens (prompt + 2 x max_tokens) in flight per replica that one "
        "band's tenants share by weight while more than one is active; a tenant at its "
        "share waits at the gateway, so a tenant of short prompts gets its share beside "
        "one of long prompts even when the replicas would accept everything (costs prompt "
        "throughput while tenants contend). auto (default): each replica's learnt slots x "
        "1.5 x the service of the last 256 requests' first quartile; off: no bound",
    )
    group.add_argument(
        "--headroom-kv-usage",
        type=float,
        default=_FLOW.headroom_kv,
        help="sheddable requests dispatch only to replicas under this KV-cache usage",
    )


def _amount(value: str | float, flag: str, unit: str) -> float | None:
    """A flag's positive amount, None for `auto` or `off`; ValueError names the flag."""
    if value in ("auto", "off"):
        return None
    try:
        amount = float(value)
    except ValueError:
        raise ValueError(f"{flag}: a number of {unit}, auto or off") from None
    if not 0 < amount < float("inf"):
        raise ValueError(f"{flag}: more than 0 {unit}")
    return amount


def settings_from(args: argparse.Namespace) -> TenancySettings | None:
    """The tenancy settings of the flags above (None without --tenants); ValueError names
    the flag and the field of anything wrong."""
    path = getattr(args, "tenants", None)
    if not path:
        return None
    from kubellm.gateway.routing.flow import tenants
    from kubellm.gateway.routing.flow.controller import TenancySettings

    if args.band_ttl <= 0:
        raise ValueError("--band-ttl: more than 0 seconds")
    if args.max_band_queue < 1:
        raise ValueError("--max-band-queue: at least 1")
    if args.headroom_load is not None and args.headroom_load <= 0:
        raise ValueError("--headroom-load: more than 0")
    prefill = getattr(args, "headroom_prefill_rate", "auto")
    rate = _amount(prefill, "--headroom-prefill-rate", "tokens per second")
    fair = getattr(args, "fair_in_flight_tokens", "auto")
    tokens = _amount(fair, "--fair-in-flight-tokens", "tokens")
    if not 0 < args.headroom_kv_usage <= 1:
        raise ValueError("--headroom-kv-usage: above 0, at most 1")
    try:
        declared = tenants.load(path)
    except tenants.TenantsError as error:
        raise ValueError(f"--tenants: {error}") from None
    flow = FlowSettings(
        max_band=args.max_band_queue,
        max_total=max(args.max_band_queue, _FLOW.max_total),
        ttl_seconds=args.band_ttl,
        headroom_kv=args.headroom_kv_usage,
        headroom_load=args.headroom_load,
        hold_prefill=args.headroom_hold_prefill,
        headroom_prefill_rate=rate,
        headroom_prefill_learnt=prefill == "auto",
        fair_in_flight_tokens=tokens,
        fair_in_flight=fair != "off",
    )
    return TenancySettings(declared, flow, args.quota_redis)
