"""status.adapters: the autoscaler reads each ready replica's /v1/models and
`vllm:lora_requests_info` and writes, per adapter of spec.adapters, on how many ready
replicas it is loaded and active; against the Kubernetes API emulator (kmock)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from kubellm.autoscaler import adapters
from kubellm.autoscaler.adapters import ReplicaAdapters
from kubellm.autoscaler.kube_backend import KubernetesBackend
from kubellm.autoscaler.loop import Autoscaler

from kubellm import metrics
from tests.autoscaler.conftest import LLMD, SLICES, endpoint_slice, engine_text, llmd

INFO = metrics.LORA_REQUESTS_INFO


def info(running: str, waiting: str = "", at: float = 2e9) -> str:
    labels = f'max_lora="2",running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"'
    return f"# TYPE {INFO} gauge\n{INFO}{{{labels}}} {at}\n"


def cards(base: str, *names: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": base, "parent": None}]
            + [{"id": n, "parent": base} for n in names]}  # fmt: skip


@pytest.mark.parametrize(
    ("models", "text", "expected"),
    [
        (
            cards("tiny", "a", "b"),
            info("a", "b"),
            ReplicaAdapters(frozenset("ab"), frozenset("ab")),
        ),
        (cards("tiny", "a"), engine_text(0, 0, 0), ReplicaAdapters(frozenset("a"))),  # LoRA off
        (cards("other", "a"), None, ReplicaAdapters(frozenset())),  # another base's adapter
        (None, info("a"), ReplicaAdapters(None, frozenset("a"))),  # /v1/models failed
        ({"oops": 1}, "not prometheus {", ReplicaAdapters(None)),
        # vLLM keeps old label sets exported: the latest time is the current one
        (
            cards("tiny"),
            info("a", at=1e9) + info("b", at=3e9).split("\n", 1)[1],
            ReplicaAdapters(frozenset(), frozenset("b")),
        ),
    ],
)
def test_what_a_replica_holds(models: Any, text: str | None, expected: ReplicaAdapters) -> None:
    assert adapters.replica_adapters(models, text, "tiny") == expected


def test_the_status_counts_replicas_per_adapter_in_spec_order() -> None:
    replicas = [
        ReplicaAdapters(frozenset("ab"), frozenset("a")),
        ReplicaAdapters(frozenset("a")),
        ReplicaAdapters(None, frozenset("b")),  # did not answer /v1/models
    ]
    assert adapters.adapter_status(["b", "a", "c"], replicas) == [
        {"name": "b", "loadedReplicas": 1, "activeReplicas": 1, "replicas": 3},
        {"name": "a", "loadedReplicas": 2, "activeReplicas": 1, "replicas": 3},
        {"name": "c", "loadedReplicas": 0, "activeReplicas": 0, "replicas": 3},
    ]
    assert adapters.adapter_status([], replicas) is None
    assert adapters.adapter_status(["a"], []) == [
        {"name": "a", "loadedReplicas": 0, "activeReplicas": 0, "replicas": 0}
    ]


def status_writes(cluster: Any, name: str) -> list[dict[str, Any]]:
    return [
        r.data["status"]
        for r in cluster
        if r.method == "PATCH" and r.resource is not None and r.name == name
        and r.subresource == "status"
    ]  # fmt: skip


async def test_the_autoscaler_writes_status_adapters(cluster: Any, metrics_server: Any) -> None:
    """Without autoscaling too: loaded on N of M ready replicas, written only on change,
    removed when the spec lists no adapter any more; each engine scraped once a period."""
    manifest = llmd("tiny", replicas=2)
    del manifest["spec"]["autoscaling"]
    manifest["spec"]["adapters"] = [
        {"name": "sql", "source": "file:///adapters/sql"},
        {"name": "legal", "source": "file:///adapters/legal"},
    ]
    cluster.objects[LLMD, "default", "tiny"] = manifest
    busy = await metrics_server(engine_text(0, 1, 0.1) + info("sql"))
    busy.models = cards("tiny", "sql", "legal")
    idle = await metrics_server(engine_text(0, 0, 0.0) + info(""))
    idle.models = cards("tiny", "sql")
    starting = await metrics_server(info("legal"))
    starting.models = cards("tiny", "sql", "legal")
    cluster.objects[SLICES, "default", "tiny-a"] = endpoint_slice("tiny", busy.port, [True], "a")
    cluster.objects[SLICES, "default", "tiny-b"] = endpoint_slice("tiny", idle.port, [True], "b")
    cluster.objects[SLICES, "default", "tiny-c"] = endpoint_slice(
        "tiny", starting.port, [False], "c"
    )

    async with (
        httpx.AsyncClient(base_url=str(cluster.url).rstrip("/"), timeout=10) as api_client,
        httpx.AsyncClient(timeout=2) as scrape_client,
    ):
        loop = Autoscaler(KubernetesBackend(api_client), scrape_client)
        assert await loop.step() == []  # no autoscaling: no scaling outcome
        expected = [
            {"name": "sql", "loadedReplicas": 2, "activeReplicas": 1, "replicas": 2},
            {"name": "legal", "loadedReplicas": 1, "activeReplicas": 0, "replicas": 2},
        ]
        assert cluster.objects[LLMD, "default", "tiny"].raw["status"]["adapters"] == expected
        assert (busy.scrapes, idle.scrapes, starting.scrapes) == (1, 1, 0)

        await loop.step()  # nothing changed: no write
        assert len(status_writes(cluster, "tiny")) == 1

        idle.models = cards("tiny", "sql", "legal")  # the gateway loaded legal there
        await loop.step()
        assert cluster.objects[LLMD, "default", "tiny"].raw["status"]["adapters"][1] == {
            "name": "legal", "loadedReplicas": 2, "activeReplicas": 0, "replicas": 2
        }  # fmt: skip

        manifest = dict(cluster.objects[LLMD, "default", "tiny"].raw)
        manifest["spec"] = {**manifest["spec"], "adapters": []}
        cluster.objects[LLMD, "default", "tiny"] = manifest
        await loop.step()
        assert status_writes(cluster, "tiny")[-1] == {"adapters": None}
        assert not cluster.objects[LLMD, "default", "tiny"].raw["status"].get("adapters")
        await loop.step()
        assert len(status_writes(cluster, "tiny")) == 3


async def test_an_autoscaled_deployment_is_scraped_once_a_period(
    cluster: Any, metrics_server: Any
) -> None:
    manifest = llmd("tiny", replicas=1, maxReplicas=2)
    manifest["spec"]["adapters"] = [{"name": "sql", "source": "file:///adapters/sql"}]
    cluster.objects[LLMD, "default", "tiny"] = manifest
    engine = await metrics_server(engine_text(0, 1, 0.1) + info("sql"))
    engine.models = cards("tiny", "sql")
    cluster.objects[SLICES, "default", "tiny-a"] = endpoint_slice("tiny", engine.port, [True])
    async with (
        httpx.AsyncClient(base_url=str(cluster.url).rstrip("/"), timeout=10) as api_client,
        httpx.AsyncClient(timeout=2) as scrape_client,
    ):
        loop = Autoscaler(KubernetesBackend(api_client), scrape_client)
        [outcome] = await loop.step()
        assert outcome.observation.replicas[0].fresh
        status = cluster.objects[LLMD, "default", "tiny"].raw["status"]
        assert status["adapters"] == [
            {"name": "sql", "loadedReplicas": 1, "activeReplicas": 1, "replicas": 1}
        ]
        assert "autoscaler" in status  # both fields, neither overwriting the other
        assert engine.scrapes == 1
