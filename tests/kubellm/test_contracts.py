"""The contracts between components, each defined once in `kubellm.contracts`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kubellm import api, contracts


def _slice(conditions: dict[str, Any], port: str = "http", address: str = "10.0.0.1") -> dict:
    return {
        "ports": [{"name": port, "port": 8000}],
        "endpoints": [
            {"addresses": [address], "conditions": conditions, "targetRef": {"name": "pod-a"}}
        ],
    }


# (conditions, routable, draining): Kubernetes' defaults for absent conditions
CONDITIONS = [
    ({}, True, False),
    ({"ready": True}, True, False),
    ({"ready": False}, False, False),
    ({"ready": False, "serving": True, "terminating": True}, False, True),
    ({"ready": True, "terminating": True}, False, True),  # serving defaults to ready
    ({"ready": False, "serving": False, "terminating": True}, False, False),
]


@pytest.mark.parametrize(("conditions", "routable", "draining"), CONDITIONS)
def test_slice_endpoint_conditions(conditions: dict, routable: bool, draining: bool) -> None:
    [endpoint] = contracts.slice_endpoints(_slice(conditions))
    assert (endpoint.routable, endpoint.draining) == (routable, draining)
    assert (endpoint.name, endpoint.url) == ("pod-a", "http://10.0.0.1:8000")


def test_slices_without_the_http_port_or_addresses_give_no_engines() -> None:
    assert contracts.slice_endpoints(_slice({}, port="grpc")) == []
    assert contracts.slice_endpoints({"ports": [{"name": "http", "port": 1}],
                                      "endpoints": [{"addresses": []}]}) == []  # fmt: skip
    [v6] = contracts.slice_endpoints(_slice({}, address="fd00::1"))
    assert v6.url == "http://[fd00::1]:8000"


def test_a_pods_data_parallel_rank_ports_are_engines_of_their_own() -> None:
    ports = [{"name": "http", "port": 8000}, {"name": "http-dp1", "port": 8001},
             {"name": "metrics", "port": 9000}, {"name": "http-dp01", "port": 8002},
             {"name": "http-dpx", "port": 8003}, {"name": "http-dp2", "port": "8004"}]  # fmt: skip
    found = contracts.slice_endpoints({**_slice({}), "ports": ports})
    assert [e.url for e in found] == ["http://10.0.0.1:8000", "http://10.0.0.1:8001"]
    many = [{"name": f"http-dp{i}", "port": 8000 + i} for i in range(1, 100)]
    bounded = contracts.slice_endpoints({**_slice({}), "ports": [*ports[:1], *many]})
    assert len(bounded) == contracts.MAX_RANK_PORTS  # a hostile slice cannot fan out
    assert contracts.slice_endpoints({**_slice({}), "ports": ports[1:]}) == []  # no `http`


# pod name -> its replica: LeaderWorkerSet leader `<lws>-<group>`, worker
# `<lws>-<group>-<index>`; a Deployment's pod is its own replica
REPLICAS = [
    ("m-lws-0", "m-lws-0"), ("m-lws-0-1", "m-lws-0"), ("m-lws-12-3", "m-lws-12"),
    ("m-canary-lws-2-1", "m-canary-lws-2"), ("m-engine-5d9f7-x2k4q", "m-engine-5d9f7-x2k4q"),
    ("m-engine-55555-24567", "m-engine-55555-24567"), ("10.0.0.1", "10.0.0.1"),
]  # fmt: skip


@pytest.mark.parametrize(("pod", "replica"), REPLICAS)
def test_an_endpoints_replica_is_its_pod_or_its_leader_worker_set_group(pod, replica) -> None:
    assert contracts.replica_key(pod) == replica


# (engine, gpus per pod, nodes) -> data-parallel ranks each pod serves as endpoints
RANKS = [
    ({}, 8, 1, 0),
    ({"tensorParallelSize": 1, "dataParallelSize": 8}, 8, 1, 8),
    ({"tensorParallelSize": 2, "dataParallelSize": 4}, 8, 1, 4),
    ({"tensorParallelSize": 1, "dataParallelSize": 16}, 8, 2, 8),
    ({"tensorParallelSize": 8, "dataParallelSize": 2}, 8, 2, 1),
    ({"tensorParallelSize": 8, "pipelineParallelSize": 2, "dataParallelSize": 2}, 8, 4, 0),
]


@pytest.mark.parametrize(("engine", "gpus", "nodes", "ranks"), RANKS)
def test_ranks_are_endpoints_when_each_lies_whole_inside_a_pod(engine, gpus, nodes, ranks):
    resources = {"gpu": {"count": gpus}, "nodes": nodes}
    spec = api.LLMDeploymentSpec.model_validate(
        {"model": {"source": "hf://a/b"}, "engine": engine, "resources": resources}
    )
    assert contracts.dp_ranks_per_pod(spec) == ranks
    names = [name for name, _ in contracts.serving_ports(spec)]
    assert names == ["http", *(f"http-dp{i}" for i in range(1, ranks))]


def test_labels_carry_the_deployment_label_and_the_selector_is_part_of_them() -> None:
    labels = contracts.engine_labels("chat")
    assert labels[contracts.DEPLOYMENT_LABEL] == "chat"
    assert contracts.selector_labels("chat").items() <= labels.items()


def _deployment(**spec: Any) -> api.LLMDeployment:
    return api.LLMDeployment.model_validate(
        {"apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
         "metadata": {"name": "chat"}, "spec": {"model": {"source": "hf://o/m"}, **spec}}
    )  # fmt: skip


@pytest.mark.parametrize("url", ["https://api.example.com/v1", "https://api.example.com/v1/"])
def test_fallback_target_drops_a_trailing_slash(url: str) -> None:
    ref = {"name": "fallback-api"}
    spec = _deployment(
        fallback={"url": url, "model": "gpt", "maxConcurrency": 3, "apiKeySecretRef": ref}
    ).spec
    target = contracts.fallback_target(spec.fallback, "sk-x")
    assert target == contracts.FallbackTarget(
        "https://api.example.com/v1", "gpt", "sk-x", 3, ("saturated", "no-ready-replicas")
    )
    assert "sk-x" not in repr(target)
    assert contracts.fallback_target(_deployment().spec.fallback) is None
    assert contracts.fallback_target(api.Fallback.model_construct(url=None)) is None


def test_the_engine_spec_document_keeps_only_what_shapes_the_engine() -> None:
    a = _deployment(replicas=1, engine={"maxNumSeqs": 8})
    b = _deployment(replicas=5, engine={"maxNumSeqs": 8}, routing={"policy": "least-load"})
    assert contracts.engine_spec_json(a) == contracts.engine_spec_json(b)
    document = json.loads(contracts.engine_spec_json(a))
    assert set(document["spec"]) == {"model", "engine", "resources"}
    assert document["spec"]["engine"]["maxNumSeqs"] == 8
    assert api.LLMDeployment.model_validate(document).spec.engine.max_num_seqs == 8
