"""`kubellm usage`: the per-tenant usage and cost table, from a gateway's /metrics.

    kubellm usage --gateway http://127.0.0.1:9090
    kubellm usage --gateway http://gw:9090 --gpu-hour-price 2.5 --gpus 4 --hours 24 \\
        --api-price-per-million 0.6

Per tenant: requests (answered 2xx, refused 4xx/5xx), prompt and output tokens served by
the replicas and by the fallback API, the mean admission wait, the TTFT p99 (from the
tenant's histogram, as Prometheus' histogram_quantile reads it), SLO attainment (answers
meeting the TTFT and ITL targets over 200 answers), dropped (flow control) and throttled
(quota) counts, and, given prices, cost: the fleet's GPU spend over the period shared by
replica tokens (prompt + output), plus fallback tokens at the API's price.

Point `--gateway` at the gateway's metrics port (`--metrics-port`): a gateway that asks
API keys (or has tenants) does not serve /metrics on its API port, since it shows every
tenant's usage. The counters are the gateway's since it started (one replica's; sum
several with Prometheus: `sum by (tenant) (kubellm_gateway_tenant_tokens_total)`). The
table is a pure function of the metrics text (`rows`); the scrape is the only I/O.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics


@dataclass
class Usage:
    tenant: str
    answered: float = 0.0
    refused: float = 0.0
    tokens: dict[tuple[str, str], float] = field(default_factory=dict)  # (route, kind)
    queue_sum: float = 0.0
    queue_count: float = 0.0
    slo_met: float = 0.0
    dropped: float = 0.0
    throttled: float = 0.0
    cost: float | None = None
    ttft_buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count

    def token(self, route: str, kind: str) -> float:
        return self.tokens.get((route, kind), 0.0)

    @property
    def replica_tokens(self) -> float:
        return self.token("replica", "prompt") + self.token("replica", "completion")

    @property
    def fallback_tokens(self) -> float:
        return self.token("fallback", "prompt") + self.token("fallback", "completion")

    @property
    def attainment(self) -> float | None:
        return self.slo_met / self.answered if self.answered else None

    @property
    def ttft_p99(self) -> float | None:
        return metrics.histogram_quantile(0.99, self.ttft_buckets.items())


@dataclass(frozen=True)
class Prices:
    gpu_hour: float | None = None
    gpus: float = 1.0
    hours: float = 1.0
    api_per_million: float | None = None


def rows(text: str, prices: Prices | None = None) -> list[Usage]:
    """The usage of each tenant in a gateway's metrics text, by tenant name."""
    found: dict[str, Usage] = {}

    def of(name: str) -> Usage:
        if name not in found:
            found[name] = Usage(name)
        return found[name]

    queue = metrics.GATEWAY_TENANT_QUEUE
    ttft_bucket = f"{metrics.GATEWAY_TENANT_TTFT}_bucket"
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            tenant = s.labels.get("tenant")
            if tenant is None:
                continue
            if s.name == metrics.GATEWAY_TENANT_REQUESTS:
                u = of(tenant)
                if s.labels.get("code", "").startswith("2"):
                    u.answered += s.value
                else:
                    u.refused += s.value
            elif s.name == metrics.GATEWAY_TENANT_TOKENS:
                key = (s.labels.get("target", ""), s.labels.get("kind", ""))
                u = of(tenant)
                u.tokens[key] = u.tokens.get(key, 0.0) + s.value
            elif s.name == f"{queue}_sum":
                of(tenant).queue_sum += s.value
            elif s.name == f"{queue}_count":
                of(tenant).queue_count += s.value
            elif s.name == metrics.GATEWAY_TENANT_GOODPUT:
                of(tenant).slo_met += s.value
            elif s.name == metrics.GATEWAY_TENANT_DROPPED:
                of(tenant).dropped += s.value
            elif s.name == metrics.GATEWAY_TENANT_THROTTLED:
                of(tenant).throttled += s.value
            elif s.name == ttft_bucket:
                buckets = of(tenant).ttft_buckets
                le = float(s.labels.get("le", "+Inf"))
                buckets[le] = buckets.get(le, 0.0) + s.value
    out = [found[name] for name in sorted(found)]
    if prices is not None:
        price(out, prices)
    return out


def price(usage: list[Usage], prices: Prices) -> None:
    """Cost per tenant: the GPU spend shared by replica tokens, plus fallback tokens at the
    API's price (each part only when its price is given)."""
    if prices.gpu_hour is None and prices.api_per_million is None:
        return
    total = sum(u.replica_tokens for u in usage)
    spend = (prices.gpu_hour or 0.0) * prices.gpus * prices.hours
    for u in usage:
        gpu = spend * u.replica_tokens / total if total and prices.gpu_hour else 0.0
        api = u.fallback_tokens / 1e6 * (prices.api_per_million or 0.0)
        u.cost = gpu + api


def render(usage: list[Usage]) -> str:
    headers = [
        "tenant", "answered", "refused", "replica in", "replica out", "fallback in",
        "fallback out", "mean wait s", "slo met", "dropped", "throttled", "cost",
        "ttft p99 s",
    ]  # fmt: skip
    table = [headers]
    for u in usage:
        wait = u.queue_sum / u.queue_count if u.queue_count else None
        attained = u.attainment
        table.append([
            u.tenant, f"{u.answered:.0f}", f"{u.refused:.0f}",
            f"{u.token('replica', 'prompt'):.0f}", f"{u.token('replica', 'completion'):.0f}",
            f"{u.token('fallback', 'prompt'):.0f}", f"{u.token('fallback', 'completion'):.0f}",
            "-" if wait is None else f"{wait:.3f}",
            "-" if attained is None else f"{100 * attained:.1f}%",
            f"{u.dropped:.0f}", f"{u.throttled:.0f}",
            "-" if u.cost is None else f"{u.cost:.2f}",
            "-" if u.ttft_p99 is None else f"{u.ttft_p99:.3f}",
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                  enumerate(zip(row, widths, strict=True)))
        for row in table
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway", required=True, metavar="URL", help="a gateway's base URL (its /metrics)"
    )
    parser.add_argument("--gpu-hour-price", type=float, default=None, help="one GPU, per hour")
    parser.add_argument("--gpus", type=float, default=1.0, help="GPUs in the fleet")
    parser.add_argument("--hours", type=float, default=1.0, help="hours the counters cover")
    parser.add_argument(
        "--api-price-per-million", type=float, default=None, help="the fallback API's price"
    )
    parser.add_argument("--timeout", type=float, default=10.0)


def run(args: argparse.Namespace) -> int:
    import httpx

    for name in ("gpu_hour_price", "api_price_per_million"):
        value = getattr(args, name)
        if value is not None and value < 0:
            print(f"kubellm usage: --{name.replace('_', '-')}: at least 0", file=sys.stderr)
            return 2
    for name in ("gpus", "hours", "timeout"):
        if getattr(args, name) <= 0:
            print(f"kubellm usage: --{name}: more than 0", file=sys.stderr)
            return 2
    url = args.gateway.rstrip("/") + "/metrics"
    try:
        response = httpx.get(url, timeout=args.timeout)
    except httpx.HTTPError as error:
        print(f"kubellm usage: {url}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        hint = ""
        if response.status_code in (401, 403):  # a gateway that asks keys serves it elsewhere
            hint = " (a gateway that asks API keys serves /metrics on its --metrics-port only)"
        print(f"kubellm usage: {url} answered HTTP {response.status_code}{hint}", file=sys.stderr)
        return 1
    prices = Prices(args.gpu_hour_price, args.gpus, args.hours, args.api_price_per_million)
    try:
        usage = rows(response.text, prices)
    except ValueError as error:
        print(f"kubellm usage: {url}: not Prometheus text: {error}", file=sys.stderr)
        return 1
    if not usage:
        print("kubellm usage: no tenant series (is the gateway run with --tenants?)")
        return 0
    sys.stdout.write(render(usage))
    return 0
