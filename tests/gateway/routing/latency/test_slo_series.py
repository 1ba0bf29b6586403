"""Each deployment's SLO is exported as series the recording rules can join on `le`."""

from __future__ import annotations

import pytest
from kubellm.gateway.routing.latency import metrics as slo_metrics
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics


@pytest.mark.parametrize(
    ("target", "buckets", "label"),
    [(0.25, (0.1, 0.25, 0.5), "0.25"), (0.3, (0.1, 0.25, 0.5), "0.25"),
     (2, (1, 2, 4), "2.0"), (0.001, (0.01, 0.1), "0.01")],
)  # fmt: skip
def test_bucket_label_is_the_bucket_at_or_under_the_target(
    target: float, buckets: tuple[float, ...], label: str
) -> None:
    assert slo_metrics.bucket_label(target, buckets) == label


def test_slo_series_name_a_real_bucket_of_the_histograms() -> None:
    m = slo_metrics.create()
    labels = ("tiny", "tiny", "default")
    m.publish_slo(labels, ttft=2.0, itl=0.25, objective=0.99)
    m.ttft.labels(*labels).observe(1.0)
    m.itl.labels(*labels).observe(0.2)
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())
    }
    targets = {s.labels["kind"]: s for s in families[metrics.GATEWAY_SLO_TARGET].samples}
    assert targets["ttft"].value == 2.0 and targets["itl"].value == 0.25
    for kind, histogram in (("ttft", metrics.GATEWAY_TTFT), ("itl", metrics.GATEWAY_ITL)):
        bucket_les = {
            s.labels["le"] for s in families[histogram].samples if s.name.endswith("_bucket")
        }
        assert targets[kind].labels["le"] in bucket_les
    (objective,) = families[metrics.GATEWAY_SLO_OBJECTIVE].samples
    assert objective.value == 0.99


def test_each_endpoint_is_exported_with_its_state():
    from kubellm.gateway.discovery.base import Endpoint, FixedDiscovery, ModelTarget
    from kubellm.gateway.routing.scheduler import Scheduler

    urls = ("http://a:1", "http://b:1", "http://c:1", "http://d:1")
    target = ModelTarget("m", "d", endpoints=(
        Endpoint(urls[0]), Endpoint(urls[1], draining=True), Endpoint(urls[2]), Endpoint(urls[3]),
    ))  # fmt: skip
    scheduler = Scheduler(FixedDiscovery({"m": target}))
    scheduler.outliers.failure(urls[2], fatal=True)
    scheduler.load.scrape_failed(urls[3])
    scheduler.update_ready_gauge()
    sample = scheduler.metrics.registry.get_sample_value
    for url, state in zip(urls, ("ready", "draining", "ejected", "down"), strict=True):
        labels = {"model": "m", "deployment": "d", "namespace": "default", "url": url}
        assert sample("kubellm_gateway_endpoint_info", {**labels, "state": state}) == 1
    scheduler.discovery.update({})  # the model left: its endpoints' series go
    scheduler.update_ready_gauge()
    assert (
        "kubellm_gateway_endpoint_info{" not in generate_latest(scheduler.metrics.registry).decode()
    )
