"""The control loop against the Kubernetes API emulator and real /metrics endpoints on loopback."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubellm.autoscaler import cli
from kubellm.autoscaler import policy as p
from kubellm.autoscaler.kube_backend import KubernetesBackend, slice_endpoints
from kubellm.autoscaler.loop import Autoscaler
from kubellm.autoscaler.telemetry import Telemetry, app

from kubellm import metrics
from tests.autoscaler.conftest import (
    LLMD,
    SLICES,
    endpoint_slice,
    engine_text,
    gateway_text,
    llmd,
)
from tests.fixtures.polling import eventually

T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def clients(cluster: Any) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    async with (
        httpx.AsyncClient(base_url=str(cluster.url).rstrip("/"), timeout=10) as api_client,
        httpx.AsyncClient(timeout=2) as scrape_client,
    ):
        yield api_client, scrape_client


def scaler(clients: Any, clock: Clock, **kwargs: Any) -> Autoscaler:
    api_client, scrape_client = clients
    return Autoscaler(KubernetesBackend(api_client), scrape_client, clock=clock, **kwargs)


def obj(cluster: Any, name: str = "tiny") -> dict[str, Any]:
    return dict(cluster.objects[LLMD, "default", name].raw)


def scale_writes(cluster: Any, name: str = "tiny") -> list[int]:
    return [
        r.data["spec"]["replicas"]
        for r in cluster
        if r.method == "PATCH" and r.resource is not None and r.name == name
        and r.subresource == "scale"
    ]  # fmt: skip


def events(cluster: Any) -> list[dict[str, Any]]:
    """Events the autoscaler posted."""
    return [
        r.data
        for r in cluster
        if r.method == "POST" and r.resource is not None and r.resource.plural == "events"
    ]


async def add_engine(
    cluster: Any, metrics_server: Any, text: str, suffix: str, ready: bool = True
) -> Any:
    server = await metrics_server(text)
    cluster.objects[SLICES, "default", f"tiny-{suffix}"] = endpoint_slice(
        "tiny", server.port, [ready], suffix
    )
    return server


async def test_load_up_scales_at_once_and_down_after_the_window(
    cluster: Any, clients: Any, metrics_server: Any
) -> None:
    cluster.objects[LLMD, "default", "tiny"] = llmd(
        replicas=1, maxReplicas=4, targetQueueDepth=4, scaleDownStabilizationSeconds=60
    )
    first = await add_engine(cluster, metrics_server, engine_text(0, 2, 0.3), "a")
    clock = Clock()
    loop = scaler(clients, clock)

    [outcome] = await loop.step()
    assert not outcome.scaled and scale_writes(cluster) == []
    assert obj(cluster)["status"]["autoscaler"]["reason"] == p.STEADY

    # Raise the load: ten requests wait on the one replica.
    first.text = engine_text(10, 8, 1.0)
    clock.now += 5
    await loop.step()
    assert scale_writes(cluster) == [3]
    assert obj(cluster)["spec"]["replicas"] == 3
    status = obj(cluster)["status"]["autoscaler"]
    assert status["desiredReplicas"] == 3
    assert status["reason"] == p.QUEUE_DEPTH
    assert "queue 10 waiting on 1 ready" in status["message"]
    assert status["lastScaleTime"] == p.format_time(clock.now)
    assert status["queueDepth"] == 10 and status["kvCacheUsage"] == 1.0
    [event] = events(cluster)
    assert event["reason"] == p.QUEUE_DEPTH and event["involvedObject"]["name"] == "tiny"
    high_at = clock.now

    # The new replicas come up; the load drops everywhere.
    first.text = engine_text(0, 1, 0.1)
    await add_engine(cluster, metrics_server, engine_text(0, 1, 0.1), "b")
    await add_engine(cluster, metrics_server, engine_text(0, 0, 0.0), "c")
    decisions = []
    while not scale_writes(cluster)[1:] and clock.now < high_at + 120:
        clock.now += 5
        if clock.now == high_at + 30:
            loop = scaler(clients, clock)  # a restart mid-window: the state is in the status
        [outcome] = await loop.step()
        decisions.append((clock.now, outcome.decision.reason))
    assert scale_writes(cluster) == [3, 2]
    down_at = decisions[-1][0]
    assert down_at == high_at + 60
    assert {reason for t, reason in decisions[:-1]} == {p.SCALE_DOWN_STABILIZING}
    assert obj(cluster)["status"]["autoscaler"]["reason"] == p.LOW_LOAD
    assert obj(cluster)["status"]["autoscaler"]["lastScaleTime"] == p.format_time(down_at)


async def test_stale_metrics_never_scale_down(
    cluster: Any, clients: Any, metrics_server: Any
) -> None:
    cluster.objects[LLMD, "default", "tiny"] = llmd(replicas=2, scaleDownStabilizationSeconds=0)
    healthy = await add_engine(cluster, metrics_server, engine_text(0, 0, 0.0), "a")
    broken = await add_engine(cluster, metrics_server, "", "b")
    broken.status = 500
    clock = Clock()
    loop = scaler(clients, clock)
    for _ in range(3):
        clock.now += 5
        [outcome] = await loop.step()
        assert outcome.decision.reason == p.STALE_METRICS
    assert scale_writes(cluster) == []
    assert broken.scrapes == 3 and healthy.scrapes == 3

    broken.status, broken.text = 200, "not prometheus {{{"
    clock.now += 5
    [outcome] = await loop.step()
    assert outcome.decision.reason == p.STALE_METRICS and scale_writes(cluster) == []

    broken.text = engine_text(0, 0, 0.0)
    clock.now += 5
    await loop.step()
    assert scale_writes(cluster) == [1]


async def test_not_ready_replicas_are_not_scraped_and_count_as_starting(
    cluster: Any, clients: Any, metrics_server: Any
) -> None:
    cluster.objects[LLMD, "default", "tiny"] = llmd(replicas=3, maxReplicas=10)
    ready = await add_engine(cluster, metrics_server, engine_text(40, 8, 1.0), "a")
    starting = await add_engine(cluster, metrics_server, engine_text(0, 0, 0.0), "b", ready=False)
    [outcome] = await scaler(clients, Clock()).step()
    assert starting.scrapes == 0 and ready.scrapes == 1
    assert outcome.observation.starting == 2
    # 40 waiting, 2 x 8 absorbed by the starting replicas: ceil(24 / 4) = 6.
    assert scale_writes(cluster) == [6]


async def test_scale_from_zero_on_gateway_pending(
    cluster: Any, clients: Any, metrics_server: Any
) -> None:
    cluster.objects[LLMD, "default", "tiny"] = llmd(replicas=0, minReplicas=0, scaleToZero=True)
    gateway = await metrics_server(gateway_text({"tiny": 0, "other": 5}))
    clock = Clock()
    loop = scaler(clients, clock, gateway_metrics_url=gateway.url)
    await loop.step()
    assert scale_writes(cluster) == []

    gateway.text = gateway_text({"tiny": 2, "other": 5})
    clock.now += 5
    await loop.step()
    assert scale_writes(cluster) == [1]
    assert obj(cluster)["status"]["autoscaler"]["reason"] == p.GATEWAY_PENDING


async def test_only_enabled_and_valid_deployments(cluster: Any, clients: Any) -> None:
    cluster.objects[LLMD, "default", "off"] = llmd("off", replicas=0, enabled=False)
    plain = llmd("plain", replicas=0)
    del plain["spec"]["autoscaling"]
    cluster.objects[LLMD, "default", "plain"] = plain
    broken = llmd("broken", replicas=0)
    broken["spec"]["model"]["source"] = "ftp://nope"
    cluster.objects[LLMD, "default", "broken"] = broken
    cluster.objects[LLMD, "default", "on"] = llmd("on", replicas=0)
    outcomes = await scaler(clients, Clock()).step()
    assert [o.target.name for o in outcomes] == ["on"]
    assert scale_writes(cluster, "on") == [1]  # minReplicas 1, no scale-to-zero
    assert all(not scale_writes(cluster, n) for n in ("off", "plain", "broken"))


async def test_telemetry(cluster: Any, clients: Any, metrics_server: Any) -> None:
    cluster.objects[LLMD, "default", "tiny"] = llmd(replicas=1)
    await add_engine(cluster, metrics_server, engine_text(10, 8, 1.0), "a")
    telemetry = Telemetry()
    await scaler(clients, Clock(), telemetry=telemetry).step()
    labels = {"namespace": "default", "deployment": "tiny"}
    sample = telemetry.registry.get_sample_value
    assert sample("kubellm_autoscaler_desired_replicas", labels) == 3
    assert sample("kubellm_autoscaler_queue_depth", labels) == 10
    assert sample("kubellm_autoscaler_decisions_total", {**labels, "reason": p.QUEUE_DEPTH}) == 1
    assert sample("kubellm_autoscaler_scale_writes_total", labels) == 1
    transport = httpx.ASGITransport(app=app(telemetry))
    async with httpx.AsyncClient(transport=transport, base_url="http://a") as client:
        text = (await client.get("/metrics")).text
    assert 'kubellm_autoscaler_desired_replicas{deployment="tiny",namespace="default"} 3.0' in text


async def test_run_steps_until_stopped(cluster: Any, clients: Any, metrics_server: Any) -> None:
    cluster.objects[LLMD, "default", "tiny"] = llmd(replicas=1)
    engine = await add_engine(cluster, metrics_server, engine_text(0, 1, 0.5), "a")
    stop = asyncio.Event()
    task = asyncio.create_task(scaler(clients, Clock(), period=0.01).run(stop))
    await eventually(lambda: engine.scrapes >= 3 or task.done(), what="three scrapes")
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, timeout=10)


@pytest.mark.parametrize(
    ("conditions", "ready"),
    [
        ({}, True),
        ({"ready": True}, True),
        ({"ready": False}, False),
        ({"terminating": True}, False),
    ],
)
def test_slice_readiness(conditions: dict[str, bool], ready: bool) -> None:
    item = endpoint_slice("tiny", 8000, [True])
    item["endpoints"][0]["conditions"] = conditions
    [endpoint] = slice_endpoints(item)
    assert endpoint.ready is ready
    assert endpoint.metrics_url == "http://127.0.0.1:8000/metrics"


def test_slice_without_http_port_and_ipv6() -> None:
    item = endpoint_slice("tiny", 8000, [True])
    item["ports"][0]["name"] = "grpc"
    assert slice_endpoints(item) == []
    item = endpoint_slice("tiny", 8000, [True])
    item["endpoints"][0]["addresses"] = ["fd00::1"]
    assert slice_endpoints(item)[0].metrics_url == "http://[fd00::1]:8000/metrics"


async def test_cli_runs_against_a_kubeconfig(
    cluster: Any, metrics_server: Any, tmp_path: Path
) -> None:
    cluster.objects[LLMD, "default", "tiny"] = llmd(replicas=1)
    await add_engine(cluster, metrics_server, engine_text(10, 8, 1.0), "a")
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "k", "cluster": {"server": str(cluster.url).rstrip("/")}}],
                "users": [{"name": "u", "user": {"token": "secret-token"}}],
                "contexts": [{"name": "k", "context": {"cluster": "k", "user": "u"}}],
                "current-context": "k",
            }
        )
    )
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["--kubeconfig", str(kubeconfig), "--metrics-port", "0"])
    args.period = 0.05
    stop = asyncio.Event()
    task = asyncio.create_task(cli.serve(args, p.get(args.policy), stop))
    await eventually(lambda: scale_writes(cluster) or task.done(), what="a /scale write")
    assert not task.done()
    stop.set()
    assert await asyncio.wait_for(task, timeout=10) == 0
    assert scale_writes(cluster)[0] == 3
    assert all(r.headers.get("Authorization") == "Bearer secret-token" for r in cluster)


async def test_request_rate_from_successive_gateway_scrapes(
    cluster: Any, clients: Any, metrics_server: Any
) -> None:
    cluster.objects[LLMD, "default", "tiny"] = llmd(
        replicas=1, maxReplicas=8, targetRequestsPerReplica=5
    )
    await add_engine(cluster, metrics_server, engine_text(0, 6, 0.1), "a")  # KV, queue: 1
    gateway = await metrics_server(gateway_text({"tiny": 6}, {"tiny": 100}))
    clock = Clock()
    [outcome] = await scaler(clients, clock, gateway_metrics_url=gateway.url).step()
    assert outcome.observation.request_rate is None  # one sample: no rate yet
    assert scale_writes(cluster) == []
    assert len(obj(cluster)["status"]["autoscaler"]["requestSamples"]) == 1

    # A restarted loop: the first sample comes back from the status. 80 more admitted in 5 s.
    gateway.text = gateway_text({"tiny": 10}, {"tiny": 176})
    clock.now += 5
    [outcome] = await scaler(clients, clock, gateway_metrics_url=gateway.url).step()
    assert outcome.observation.request_rate == pytest.approx(16)
    assert scale_writes(cluster) == [4]  # ceil(16 / 5)
    status = obj(cluster)["status"]["autoscaler"]
    assert status["reason"] == p.REQUEST_RATE and status["requestRate"] == 16
    assert "rate 16.0 req/s (target 5/replica) asks 4" in status["message"]


async def test_without_a_rate_target_the_loop_learns_it_while_saturated(
    cluster: Any, clients: Any, metrics_server: Any
) -> None:
    cluster.objects[LLMD, "default", "tiny"] = llmd(replicas=1, maxReplicas=8)
    await add_engine(cluster, metrics_server, engine_text(8, 6, 0.9), "a")  # saturated
    gateway = await metrics_server(gateway_text({"tiny": 6}, {"tiny": 100}))
    clock = Clock()
    [outcome] = await scaler(clients, clock, gateway_metrics_url=gateway.url).step()
    status = obj(cluster)["status"]["autoscaler"]
    assert outcome.observation.request_rate is None  # one sample: no rate yet
    assert len(status["requestSamples"]) == 1 and len(status["gatewaySamples"]) == 1
    assert status.get("learnedRequestsPerReplica") is None

    # 76 more answered by the one replica in 5 s, its queue at its target: saturated, but
    # answers lag the load at first, so nothing is learned until it has lasted 30 s
    gateway.text = gateway_text({"tiny": 10}, {"tiny": 176})
    clock.now += 5
    [outcome] = await scaler(clients, clock, gateway_metrics_url=gateway.url).step()
    status = obj(cluster)["status"]["autoscaler"]
    assert outcome.observation.replica_answer_rate == pytest.approx(76 / 5)
    assert status["saturatedSince"] and status.get("learnedRequestsPerReplica") is None

    # 30 s later, still saturated: 456 more answered, 15.2/s is what a replica serves;
    # the rate signal uses 0.8 of it
    gateway.text = gateway_text({"tiny": 10}, {"tiny": 632})
    clock.now += 30
    [outcome] = await scaler(clients, clock, gateway_metrics_url=gateway.url).step()
    status = obj(cluster)["status"]["autoscaler"]
    assert status["learnedRequestsPerReplica"] == pytest.approx(15.2)
    assert f"(target derived {0.8 * 15.2:.3g}/replica)" in status["message"]
    assert status.get("fallbackShare") is None  # no spec.fallback: the share is not weighed


async def test_the_fallbacks_load_and_refusals_reach_the_policy(
    cluster: Any, clients: Any, metrics_server: Any
) -> None:
    document = llmd(replicas=1, maxReplicas=8, targetRequestsPerReplica=5, fallbackCostRatio=6)
    document["spec"]["fallback"] = {"url": "https://api.example/v1", "maxConcurrency": 16,
                                    "apiKeySecretRef": {"name": "api"}}  # fmt: skip
    cluster.objects[LLMD, "default", "tiny"] = document
    await add_engine(cluster, metrics_server, engine_text(0, 6, 0.1), "a")
    labels = 'model="tiny",deployment="tiny",namespace="default"'
    counter, sent = metrics.GATEWAY_REQUESTS, metrics.GATEWAY_FALLBACK

    def text(fallback_answered: int, fallback_sent: int, refused: int) -> str:
        return gateway_text({"tiny": 6}) + "".join(
            [f'{counter}{{{labels},target="replica",code="200"}} 100\n',
             f'{counter}{{{labels},target="fallback",code="200"}} {fallback_answered}\n',
             f'{counter}{{{labels},target="none",code="429"}} {refused}\n',
             f"# TYPE {sent.removesuffix('_total')} counter\n",
             f'{sent}{{{labels},reason="saturated"}} {fallback_sent}\n']
        )  # fmt: skip

    gateway = await metrics_server(text(1, 11, 2))
    clock = Clock()
    await scaler(clients, clock, gateway_metrics_url=gateway.url).step()
    gateway.text = text(4, 30, 5)  # 26 at the fallback now; 3 refused in this period
    clock.now += 5
    [outcome] = await scaler(clients, clock, gateway_metrics_url=gateway.url).step()
    observed = outcome.observation
    assert observed.fallback_in_flight == 26 and observed.fallback_capacity == 16
    assert observed.refused == 3
    assert obj(cluster)["status"]["autoscaler"]["gatewaySamples"][-1]["refused"] == 5


async def test_predictive_reads_the_gateway_history_and_asks_ahead(
    cluster: Any, clients: Any, metrics_server: Any
) -> None:
    # the gateway's admitted counter on a ramp: 5 req/s growing by 0.1 req/s every second
    cluster.objects[LLMD, "default", "tiny"] = llmd(
        replicas=1, maxReplicas=8, targetRequestsPerReplica=5, predictive=True
    )
    await add_engine(cluster, metrics_server, engine_text(0, 6, 0.1), "a")
    gateway = await metrics_server(gateway_text({"tiny": 0}, {"tiny": 0}))
    clock, start = Clock(), Clock().now
    outcome = None
    for k in range(26):  # 125 s: the fit reads the last 120
        t = 5.0 * k
        gateway.text = gateway_text({"tiny": 0}, {"tiny": round(5 * t + 0.05 * t * t)})
        clock.now = start + t
        [outcome] = await scaler(clients, clock, gateway_metrics_url=gateway.url).step()
    assert outcome is not None
    assert len(outcome.observation.admitted_history) == 26
    status = obj(cluster)["status"]["autoscaler"]
    # 17.2 req/s over the last period asks 4; the line says 23.5 req/s in 60 s: 5
    assert "rate trend: 23.5 req/s in 60 s asks 5" in status["message"], status["message"]
    assert scale_writes(cluster)[-1] == 5
