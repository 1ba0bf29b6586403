"""From two scrapes (or Prometheus answers) to a snapshot: deltas over the window."""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kubellm import metrics
from kubellm.diagnose import collect, snapshot

LABELS = {"model": "m", "deployment": "m", "namespace": "default"}


class Gateway:
    """A stand-in exposing the gateway's series (names from the core contract)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        names = list(LABELS)
        self.ttft = Histogram(
            metrics.GATEWAY_TTFT, "", names, registry=r, buckets=(0.1, 0.5, 1, 2, 4, 8)
        ).labels(**LABELS)
        self.itl = Histogram(
            metrics.GATEWAY_ITL, "", names, registry=r, buckets=(0.01, 0.05, 0.1, 0.5)
        ).labels(**LABELS)
        self.queue = Histogram(
            snapshot.GATEWAY_QUEUE_WAIT, "", names, registry=r, buckets=(0.1, 1, 4, 8)
        ).labels(**LABELS)
        self.requests = Counter(
            metrics.GATEWAY_REQUESTS.removesuffix("_total"),
            "",
            [*names, "target", "code"],
            registry=r,
        )
        self.target = Gauge(metrics.GATEWAY_SLO_TARGET, "", [*names, "kind"], registry=r)
        self.target.labels(**LABELS, kind="ttft").set(1.0)
        self.target.labels(**LABELS, kind="itl").set(0.1)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


class Engine:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge(metrics.NUM_REQUESTS_WAITING, "", registry=r)
        self.running = Gauge(metrics.NUM_REQUESTS_RUNNING, "", registry=r)
        self.kv = Gauge(metrics.KV_CACHE_USAGE, "", registry=r)
        self.queries = Counter(metrics.PREFIX_CACHE_QUERIES.removesuffix("_total"), "", registry=r)
        self.hits = Counter(metrics.PREFIX_CACHE_HITS.removesuffix("_total"), "", registry=r)
        self.prompt = Counter(snapshot.PROMPT_TOKENS.removesuffix("_total"), "", registry=r)
        self.done = Counter(snapshot.REQUEST_SUCCESS.removesuffix("_total"), "", registry=r)
        self.preempt = Counter(snapshot.PREEMPTIONS.removesuffix("_total"), "", registry=r)
        self.ttft = Histogram(metrics.TIME_TO_FIRST_TOKEN, "", registry=r, buckets=(0.1, 1, 10))
        self.itl = Histogram(metrics.INTER_TOKEN_LATENCY, "", registry=r, buckets=(0.01, 0.1, 1))

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_gateway_latencies_and_shares_count_only_the_window() -> None:
    gw = Gateway()
    for _ in range(1000):  # before the window: fast, all on replicas
        gw.ttft.observe(0.05)
        gw.itl.observe(0.005)
        gw.requests.labels(**LABELS, target="replica", code="200").inc()
    before = gw.text()
    for _ in range(10):  # in the window: slow, half overflowing
        gw.ttft.observe(3.0)
        gw.itl.observe(0.03)
        gw.queue.observe(2.5)
    gw.requests.labels(**LABELS, target="replica", code="200").inc(5)
    gw.requests.labels(**LABELS, target="fallback", code="200").inc(5)
    snap = snapshot.build(10.0, (before, gw.text()), [])
    assert 2 < snap.ttft_p50_s <= 4 and 2 < snap.ttft_p95_s <= 4
    assert 0.01 < snap.itl_p95_s <= 0.05
    assert 1 < snap.queue_wait_p95_s <= 4
    assert snap.request_rate == pytest.approx(1.0)
    assert snap.fallback_share == pytest.approx(0.5)
    assert (snap.ttft_target_s, snap.itl_target_s) == (1.0, 0.1)
    assert snap.latency_source.startswith("gateway")
    assert snap.engines == 0


def test_engine_figures_are_summed_rated_and_used_for_latency_without_a_gateway() -> None:
    a, b = Engine(), Engine()
    a.queries.inc(1000)
    a.hits.inc(900)  # before the window: a warm cache
    before = [a.text(), b.text()]
    for engine, (waiting, running, kv) in zip((a, b), ((3, 10, 0.95), (1, 6, 0.7)), strict=True):
        engine.waiting.set(waiting)
        engine.running.set(running)
        engine.kv.set(kv)
        engine.queries.inc(400)
        engine.hits.inc(40)
        engine.prompt.inc(8000)
        engine.done.inc(2)
        engine.preempt.inc(3)
        engine.ttft.observe(5.0)
        engine.itl.observe(0.05)
    snap = snapshot.build(
        2.0, None, list(zip(before, [a.text(), b.text()], strict=True)), ttft_target_s=1.5
    )
    assert snap.engines == 2 and snap.waiting == 4 and snap.running == 16
    assert snap.kv_cache_usage_max == 0.95 and snap.kv_cache_usage_mean == pytest.approx(0.825)
    assert snap.prefix_cache_hit_rate == pytest.approx(0.1)
    assert snap.mean_prompt_tokens == pytest.approx(4000)
    assert snap.preemptions_per_s == pytest.approx(3.0)
    assert snap.latency_source.startswith("engines") and snap.ttft_p95_s > 1
    assert snap.ttft_target_s == 1.5 and snap.itl_target_s is None


def test_a_counter_reset_in_the_window_counts_from_zero() -> None:
    old, new = Engine(), Engine()
    old.done.inc(50)
    old.prompt.inc(50_000)
    new.done.inc(2)
    new.prompt.inc(200)
    snap = snapshot.build(1.0, None, [(old.text(), new.text())])
    assert snap.mean_prompt_tokens == pytest.approx(100)


def test_scrape_reads_each_url_around_the_window() -> None:
    gw, engine = Gateway(), Engine()
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        source = gw if request.url.port == 1 else engine
        return httpx.Response(200, text=source.text())

    def window(seconds: float) -> None:  # the traffic of the window
        assert seconds == 5
        gw.requests.labels(**LABELS, target="fallback", code="200").inc(4)
        engine.running.set(2)

    client = httpx.Client(transport=httpx.MockTransport(handler))
    snap = collect.scrape("http://g:1", ["http://e:2/"], 5, samples=1, client=client, wait=window)
    assert seen == ["http://g:1/metrics", *["http://e:2/metrics"] * 2, "http://g:1/metrics"]
    assert snap.fallback_share == 1.0 and snap.running == 2 and snap.engines == 1


def test_engine_gauges_are_averaged_over_the_window_not_read_once_at_its_end() -> None:
    engine = Engine()
    busy = iter([(8, 0.9), (8, 0.9), (0, 0.0), (0, 0.0)])

    def window(seconds: float) -> None:
        assert seconds == pytest.approx(1.0)
        running, kv = next(busy)
        engine.running.set(running)
        engine.kv.set(kv)

    client = httpx.Client(
        transport=httpx.MockTransport(lambda _: httpx.Response(200, text=engine.text()))
    )
    snap = collect.scrape(None, ["http://e"], 4, samples=4, client=client, wait=window)
    assert snap.running == pytest.approx(4.0)
    assert snap.kv_cache_usage_max == 0.9 and snap.kv_cache_usage_mean == pytest.approx(0.45)
    with pytest.raises(ValueError, match="two scrapes"):
        snapshot.build(1.0, None, [[engine.text()]])


def test_scrape_reports_a_failing_endpoint() -> None:
    client = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(503)))
    with pytest.raises(collect.CollectError, match="http://e/metrics answered HTTP 503"):
        collect.scrape(None, ["http://e"], 1, client=client, wait=lambda s: None)


def test_prometheus_queries_fill_the_snapshot() -> None:
    answers = {
        "histogram_quantile(0.95, sum by (le) (rate(kubellm_gateway_time_to_first": 3.0,
        f'{metrics.GATEWAY_REQUESTS}{{target="fallback"}}': 0.25,
        f"max({metrics.KV_CACHE_USAGE})": 0.9,
        "count(up": 2.0,
    }
    queries: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        query = parse_qs(urlparse(str(request.url)).query)["query"][0]
        queries.append(query)
        assert "[30s]" in query or "rate(" not in query
        value = next((v for k, v in answers.items() if k in query), None)
        result = [] if value is None else [{"metric": {}, "value": [0, str(value)]}]
        return httpx.Response(
            200,
            text=json.dumps(
                {"status": "success", "data": {"resultType": "vector", "result": result}}
            ),
        )

    client = httpx.Client(transport=httpx.MockTransport(handler))
    snap = collect.from_prometheus("http://prom:9090", 30, itl_target_s=0.2, client=client)
    assert snap.ttft_p95_s == 3.0 and snap.fallback_share == 0.25
    assert snap.kv_cache_usage_max == 0.9 and snap.engines == 2
    assert snap.ttft_p50_s is None and snap.itl_target_s == 0.2
    assert len(queries) == len(collect.prometheus_queries("30s"))


def test_a_prometheus_error_names_the_field() -> None:
    def handler(_: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"status": "error", "error": "parse error"})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    with pytest.raises(collect.CollectError, match="ttft_p50_s failed: parse error"):
        collect.from_prometheus("http://prom", 30, client=client)


def test_a_gateway_names_its_ready_engines_on_its_metrics():
    from kubellm.diagnose.collect import gateway_engines

    text = (
        "# TYPE kubellm_gateway_endpoint_info gauge\n"
        'kubellm_gateway_endpoint_info{model="m",deployment="m",namespace="default",'
        'url="http://10.0.0.1:8000",state="ready"} 1.0\n'
        'kubellm_gateway_endpoint_info{model="m",deployment="m",namespace="default",'
        'url="http://10.0.0.2:8000",state="down"} 1.0\n'
        'kubellm_gateway_endpoint_info{model="n",deployment="n",namespace="default",'
        'url="http://10.0.0.3:8000",state="ready"} 1.0\n'
    )
    assert gateway_engines(text) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    assert gateway_engines("") == []


def test_the_gateways_speed_factors_are_read_by_replica() -> None:
    """The gateway's slo-aware model publishes each replica's speed factor
    (routing/latency/predictions.py); the snapshot keeps the latest value per URL."""
    from kubellm.gateway.routing.latency.model import Dispatch
    from kubellm.gateway.routing.latency.predictions import Predictions

    registry = CollectorRegistry()
    predictions = Predictions(registry=registry)
    for i in range(300):  # enough answers for the factors' moving mean to settle
        d = Dispatch(prompt_tokens=100 + 10 * (i % 100))
        for url, factor in [("http://a", 1.0), ("http://b", 1.0), ("http://c", 2.0)]:
            prior = predictions.model.prior
            predictions.answered(("m", "d", "ns"), url, d, factor * prior.ttft(d),
                                 factor * prior.itl(d))  # fmt: skip
    predictions.publish_speed(("m", "d", "ns"), ["http://a", "http://b", "http://c"])
    text = generate_latest(registry).decode()
    snap = snapshot.build(10.0, (text, text), [])
    assert snap.speed_factors["http://c"] == pytest.approx(2.0, rel=0.05)
    assert snap.speed_factors["http://a"] == pytest.approx(1.0, rel=0.05)
