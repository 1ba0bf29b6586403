"""The I/O edge of `kubellm diagnose`: scrape /metrics twice, or query Prometheus."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kubellm import metrics
from kubellm.diagnose import snapshot
from kubellm.diagnose.snapshot import Snapshot


class CollectError(RuntimeError):
    pass


def _get(client: httpx.Client, base: str) -> str:
    url = base.rstrip("/") + "/metrics"
    try:
        response = client.get(url)
    except httpx.ConnectError:
        raise CollectError(
            f"cannot connect to {url}: connection refused or host unreachable"
        ) from None
    except httpx.TimeoutException:
        raise CollectError(f"{url} did not answer in time") from None
    except httpx.HTTPError as error:
        raise CollectError(f"{url}: {type(error).__name__}: {error}") from None
    if response.status_code != 200:
        raise CollectError(f"{url} answered HTTP {response.status_code}")
    return response.text


@dataclass
class LocalFleet:
    """What a running `kubellm up` wrote down about itself (its run directory's state)."""

    gateway: str
    engines: list[str]  # base URLs of the ready replicas
    specs: dict[str, dict[str, Any]]  # LLMDeployment name -> its spec (JSON), when recorded


def local_fleet(run_dir: str | Path, state_file: str = "fleet.json") -> LocalFleet | None:
    """The fleet `kubellm up` runs from this directory, the way `kubellm status` finds it."""
    path = Path(run_dir) / state_file
    try:
        state = json.loads(path.read_text())
        deployments = state["deployments"]
        gateway = str(state["gateway"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    engines = [
        str(replica["url"])
        for deployment in deployments.values()
        for replica in deployment.get("replicas", [])
        if replica.get("state") == "ready" and replica.get("url")
    ]
    specs = {name: d["spec"] for name, d in deployments.items() if isinstance(d.get("spec"), dict)}
    return LocalFleet(gateway=gateway, engines=engines, specs=specs)


def gateway_engines(metrics_text: str) -> list[str]:
    """The ready engines a gateway reports on its /metrics (`kubellm_gateway_endpoint_info`)."""
    from prometheus_client.parser import text_string_to_metric_families

    urls: list[str] = []
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == metrics.GATEWAY_ENDPOINT_INFO and sample.value == 1:
                url = sample.labels.get("url")
                if url and sample.labels.get("state") == "ready" and url not in urls:
                    urls.append(url)
    return urls


def engines_behind(gateway_url: str, client: httpx.Client | None = None) -> list[str]:
    """Ask a gateway which engines it routes to (its /metrics), so none must be named."""
    own = client is None
    client = client or httpx.Client(timeout=10.0)
    try:
        return gateway_engines(_get(client, gateway_url))
    finally:
        if own:
            client.close()


def scrape(
    gateway_url: str | None,
    engine_urls: Sequence[str],
    window_s: float,
    ttft_target_s: float | None = None,
    itl_target_s: float | None = None,
    *,
    samples: int = 5,
    client: httpx.Client | None = None,
    wait: Callable[[float], None] = time.sleep,
) -> Snapshot:
    """Scrape everything, then `samples` more times across the window, and distil a snapshot.

    Counters and histograms are differenced between the first and the last
    scrape; engine gauges are averaged over the samples. `wait` is the pause
    between scrapes: the window is the measurement, not a synchronisation.
    """
    if samples < 1:
        raise CollectError("samples: must be at least 1")
    own = client is None
    client = client or httpx.Client(timeout=10.0)
    try:
        gateway = [_get(client, gateway_url)] if gateway_url else []
        engines = [[_get(client, u)] for u in engine_urls]
        started = time.monotonic()
        for _ in range(samples):
            wait(window_s / samples)
            for texts, url in zip(engines, engine_urls, strict=True):
                texts.append(_get(client, url))
        if gateway_url:
            gateway.append(_get(client, gateway_url))
        elapsed = max(time.monotonic() - started, 1e-3)
    finally:
        if own:
            client.close()
    return snapshot.build(
        elapsed,
        (gateway[0], gateway[1]) if gateway_url else None,
        engines,
        ttft_target_s=ttft_target_s,
        itl_target_s=itl_target_s,
    )


def prometheus_queries(w: str) -> dict[str, str]:
    """PromQL for each snapshot field, over a window `w` (e.g. '30s')."""

    def q(name: str, quantile: float) -> str:
        return f"histogram_quantile({quantile}, sum by (le) (rate({name}_bucket[{w}])))"

    return {
        "ttft_p50_s": q(metrics.GATEWAY_TTFT, 0.5),
        "ttft_p95_s": q(metrics.GATEWAY_TTFT, 0.95),
        "itl_p50_s": q(metrics.GATEWAY_ITL, 0.5),
        "itl_p95_s": q(metrics.GATEWAY_ITL, 0.95),
        "queue_wait_p95_s": q(snapshot.GATEWAY_QUEUE_WAIT, 0.95),
        "request_rate": f"sum(rate({metrics.GATEWAY_REQUESTS}[{w}]))",
        "fallback_share": f'sum(rate({metrics.GATEWAY_REQUESTS}{{target="fallback"}}[{w}])) / '
        f"sum(rate({metrics.GATEWAY_REQUESTS}[{w}]))",
        "engines": f'count(up{{job=~".*engine.*"}} == 1) or count({metrics.KV_CACHE_USAGE})',
        "waiting": f"sum({metrics.NUM_REQUESTS_WAITING})",
        "running": f"sum({metrics.NUM_REQUESTS_RUNNING})",
        "kv_cache_usage_max": f"max({metrics.KV_CACHE_USAGE})",
        "kv_cache_usage_mean": f"avg({metrics.KV_CACHE_USAGE})",
        "prefix_cache_hit_rate": f"sum(rate({metrics.PREFIX_CACHE_HITS}[{w}])) / "
        f"sum(rate({metrics.PREFIX_CACHE_QUERIES}[{w}]))",
        "mean_prompt_tokens": f"sum(rate({snapshot.PROMPT_TOKENS}[{w}])) / "
        f"sum(rate({snapshot.REQUEST_SUCCESS}[{w}]))",
        "preemptions_per_s": f"sum(rate({snapshot.PREEMPTIONS}[{w}]))",
        "generation_tokens_per_s": f"sum(rate({snapshot.GENERATION_TOKENS}[{w}]))",
        "ttft_target_s": f'max({metrics.GATEWAY_SLO_TARGET}{{kind="ttft"}})',
        "itl_target_s": f'max({metrics.GATEWAY_SLO_TARGET}{{kind="itl"}})',
    }


def from_prometheus(
    url: str,
    window_s: float,
    ttft_target_s: float | None = None,
    itl_target_s: float | None = None,
    *,
    client: httpx.Client | None = None,
) -> Snapshot:
    """The same snapshot from a Prometheus server's instant queries over the window."""
    own = client is None
    client = client or httpx.Client(timeout=10.0)
    window = f"{max(1, round(window_s))}s"
    values: dict[str, float | None] = {}
    try:
        for field, query in prometheus_queries(window).items():
            endpoint = url.rstrip("/") + "/api/v1/query"
            try:
                response = client.get(endpoint, params={"query": query})
            except httpx.HTTPError as error:
                raise CollectError(f"cannot query Prometheus at {endpoint}: {error}") from None
            body = response.json() if response.status_code in (200, 400, 422) else {}
            if body.get("status") != "success":
                reason = body.get("error", f"HTTP {response.status_code}")
                raise CollectError(f"Prometheus query for {field} failed: {reason}")
            result = body["data"]["result"]
            value = float(result[0]["value"][1]) if result else None
            values[field] = None if value is None or math.isnan(value) else value
    finally:
        if own:
            client.close()
    engines = values.pop("engines")
    snap = Snapshot(window_s=window_s, engines=int(engines or 0), **values)  # type: ignore[arg-type]
    if snap.ttft_p50_s is not None:
        snap.latency_source = "gateway (kubellm_gateway_*, via Prometheus)"
    if ttft_target_s is not None:
        snap.ttft_target_s = ttft_target_s
    if itl_target_s is not None:
        snap.itl_target_s = itl_target_s
    return snap
