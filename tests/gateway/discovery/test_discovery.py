"""Discovery: the static file, EndpointSlices and LLMDeployments, the watch loop."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import yaml
from kubellm.gateway.discovery import kubernetes as k8s
from kubellm.gateway.discovery.base import Endpoint
from kubellm.gateway.discovery.static import StaticConfigError, StaticDiscovery, load, parse

from kubellm import kube

EXAMPLE = Path(__file__).parents[3] / "examples" / "gateway-static.yaml"


def test_example_file_parses():
    models = load(EXAMPLE, env={"OPENAI_API_KEY": "sk-test"})
    tiny = models["tiny"]
    assert [e.url for e in tiny.routable] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert tiny.endpoints[2].draining
    assert tiny.routing.policy == "prefix-aware" and tiny.slo.ttft_seconds == 2.0
    assert tiny.fallback.api_key == "sk-test" and tiny.fallback.max_concurrency == 32
    assert "sk-test" not in repr(tiny)  # keys are never printed
    assert models["external-only"].endpoints == ()


@pytest.mark.parametrize(
    ("document", "needle"),
    [
        ({"models": [{"name": "a", "routing": {"policy": "random"}}]}, "models[0].routing.policy"),
        ({"models": [{"name": "a", "endpoints": ["ftp://x"]}]}, "http:// or https://"),
        ({"models": [{"name": "a", "slo": {"ttftSeconds": 0}}]}, "models[0].slo.ttftSeconds"),
        ({"models": [{"name": "a", "fallback": {"model": "m"}}]}, "spec.fallback.url is required"),
        ({"models": [{"name": "a", "colour": "red"}]}, "models[0].colour: unknown field"),
        ({"models": [{"name": "a"}, {"name": "a"}]}, "models[1].name: duplicate"),
        (
            {"models": [{"name": "a", "fallback": {"url": "http://x", "apiKeyEnv": "NOPE_KEY"}}]},
            "NOPE_KEY is not set",
        ),
    ],
)
def test_bad_static_files_name_the_field(document, needle):
    with pytest.raises(StaticConfigError) as caught:
        parse(document, env={})
    assert needle in str(caught.value)


def test_inline_fallback_key():
    models = parse({"models": [{"name": "a", "fallback": {"url": "http://x/v1", "apiKey": "k"}}]})
    assert models["a"].fallback.api_key == "k"


def test_a_static_model_may_run_a_canary_rollout():
    """Outside Kubernetes (`kubellm epp --static`): endpoints carry their revision and
    `rollout` is status.rollout's split, the shadow step included."""
    rollout = {"canaryRevision": "r2", "phase": "Progressing", "canaryWeight": 0,
               "shadow": {"share": 0.2}}  # fmt: skip
    document = {"models": [{"name": "m", "rollout": rollout, "endpoints": [
        "http://127.0.0.1:8001", {"url": "http://127.0.0.1:8002", "revision": "r2"}]}]}  # fmt: skip
    target = parse(document)["m"]
    assert [e.revision for e in target.endpoints] == [None, "r2"]
    split = target.canary
    assert (split.revision, split.weight, split.shadow_share, split.shadow_concurrency) == (
        "r2", 0, 0.2, 4)  # fmt: skip
    assert parse({"models": [{"name": "m"}]})["m"].canary is None
    with pytest.raises(StaticConfigError, match=r"rollout\.phase"):
        parse({"models": [{"name": "m", "rollout": {**rollout, "phase": "Sideways"}}]})


def test_a_static_endpoint_may_name_its_own_kv_events_port():
    """Replicas on one host (prefixIndex precise) publish on ports of their own: the
    gateway follows each on its endpoint's port, else on routing.kvEventsPort."""
    from kubellm.gateway.routing.index.precise_routing import default_address

    document = {"models": [{"name": "m", "routing": {"prefixIndex": "precise"}, "endpoints": [
        "http://127.0.0.1:8001", {"url": "http://127.0.0.1:8002", "kvEventsPort": 7002},
    ]}]}  # fmt: skip
    target = parse(document)["m"]
    assert [e.kv_events_port for e in target.endpoints] == [None, 7002]
    addresses = [default_address(target, e) for e in target.endpoints]
    assert [a.publish for a in addresses] == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:7002"]
    assert addresses[1].replay == "tcp://127.0.0.1:7003"
    with pytest.raises(StaticConfigError, match="kvEventsPort"):
        parse({"models": [{"name": "m", "endpoints": [
            {"url": "http://127.0.0.1:8002", "kvEventsPort": 65535}]}]})  # fmt: skip


def test_static_file_reload_drops_removed_endpoints(tmp_path):
    path = tmp_path / "static.yaml"
    path.write_text(
        yaml.safe_dump({"models": [{"name": "a", "endpoints": ["http://h1", "http://h2"]}]})
    )
    discovery = StaticDiscovery(path)
    assert not discovery.reload()
    path.write_text(yaml.safe_dump({"models": [{"name": "a", "endpoints": ["http://h2"]}]}))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert discovery.reload()
    assert [e.url for e in discovery.snapshot()["a"].routable] == ["http://h2"]
    path.write_text("models: [{name: a, endpoints: 3}]")  # broken: keep the last good view
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert not discovery.reload()
    assert [e.url for e in discovery.snapshot()["a"].routable] == ["http://h2"]


def _slice(owner: str, endpoints: list[tuple[str, dict]], ns: str = "ml", port: str = "http"):
    return {
        "metadata": {"name": f"{owner}-x", "namespace": ns,
                     "labels": {"kubellm.io/deployment": owner}},
        "ports": [{"name": "metrics", "port": 9090}, {"name": port, "port": 8000}],
        "endpoints": [{"addresses": [a], "conditions": c} for a, c in endpoints],
    }  # fmt: skip


def _llmd(name: str, ns: str = "ml", **spec):
    return {
        "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": ns, "uid": "u", "resourceVersion": "7"},
        "spec": {"model": {"source": "hf://org/m"}, **spec},
        "status": {"replicas": 2},
    }  # fmt: skip


def test_endpoint_conditions_map_to_routable_and_draining():
    s = _slice("a", [
        ("10.0.0.1", {"ready": True}),
        ("10.0.0.2", {"ready": False, "serving": True, "terminating": True}),
        ("10.0.0.3", {"ready": False, "serving": False, "terminating": True}),
        ("10.0.0.4", {"ready": False}),
        ("fd00::5", {}),
    ])  # fmt: skip
    assert k8s.endpoints_of(s) == [
        Endpoint("http://10.0.0.1:8000"),
        Endpoint("http://10.0.0.2:8000", draining=True),
        Endpoint("http://[fd00::5]:8000"),
    ]
    assert k8s.endpoints_of(_slice("a", [("10.0.0.1", {})], port="grpc")) == []


def test_build_targets_from_deployments_slices_and_secrets():
    deployments = k8s.parse_deployments([
        _llmd("llama", model={"source": "hf://meta/llama", "servedName": "llama-8b"},
              routing={"policy": "least-load"}, slo={"ttftSeconds": 1},
              fallback={"url": "https://api.example.com/v1", "model": "gpt",
                        "apiKeySecretRef": {"name": "fb", "key": "token"}}),
        _llmd("tiny"),
        _llmd("broken", spec_is="bad"),  # invalid: skipped, not fatal
        _llmd("tiny-again", ns="other", model={"source": "hf://x/y", "servedName": "tiny"}),
    ])  # fmt: skip
    assert [d.metadata.name for d in deployments] == ["llama", "tiny", "tiny-again"]
    assert k8s.secret_keys(deployments) == {("ml", "fb", "token")}
    slices = [
        _slice("llama", [("10.0.0.1", {"ready": True})]),
        _slice("llama", [("10.0.0.2", {"ready": True})]),
        _slice("tiny", [("10.0.1.1", {"ready": True})], ns="elsewhere"),  # wrong namespace
    ]
    targets = k8s.build_targets(deployments, slices, {("ml", "fb", "token"): "sk-x"})
    assert set(targets) == {"llama-8b", "tiny"}
    llama = targets["llama-8b"]
    assert (llama.deployment, llama.namespace) == ("llama", "ml")
    assert [e.url for e in llama.routable] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert llama.routing.policy == "least-load" and llama.slo.ttft_seconds == 1
    assert llama.fallback.api_key == "sk-x" and llama.fallback.model == "gpt"
    assert llama.model_source == "hf://meta/llama"  # precise routing's default tokenizer
    assert targets["tiny"].namespace == "ml" and targets["tiny"].endpoints == ()


# status.capacity as the operator writes it -> the bound discovery carries (None: no prior)
BOUNDS_TABLE = [
    ({"capacity": {"maxConcurrentSequences": 40, "decodeTokensPerSecondBound": 143.2}}, 143.2),
    ({"capacity": {"decodeTokensPerSecondBound": 50}}, 50.0),
    ({"capacity": {"maxConcurrentSequences": 40}}, None),  # no GPU bandwidth in the spec
    ({"replicas": 2}, None),  # not planned yet
    ({"capacity": None}, None),
    ({"capacity": {"decodeTokensPerSecondBound": 0}}, None),
    ({"capacity": {"decodeTokensPerSecondBound": "fast"}}, None),
    ({"capacity": {"decodeTokensPerSecondBound": True}}, None),
    ({"capacity": "x"}, None),
]


@pytest.mark.parametrize(("status", "bound"), BOUNDS_TABLE)
def test_a_models_decode_bound_comes_from_its_status_capacity(status, bound):
    """The slo-aware latency model's prior for the model's replicas (Prior.from_capacity)."""
    item = {**_llmd("llama"), "status": status}
    slices = [_slice("llama", [("10.0.0.1", {"ready": True})])]
    bounds = k8s.decode_bounds([item])
    targets = k8s.build_targets(k8s.parse_deployments([item]), slices, {}, None, bounds)
    assert targets["llama"].decode_tokens_per_second_bound == bound
    assert k8s.build_targets(k8s.parse_deployments([item]), slices, {})[
        "llama"
    ].decode_tokens_per_second_bound is None  # fmt: skip


# status.capacity -> the tiers the approximate prefix index models (None: no host tier)
TIERS_TABLE = [
    ({"capacity": {"kvTokensGPU": 440_000, "kvTokensHost": 1_600_000}}, (440_000, 1_600_000)),
    ({"capacity": {"kvTokensGPU": 440_000}}, None),  # no host tier
    ({"capacity": {"kvTokensGPU": 440_000, "kvTokensHost": 0}}, None),
    ({"capacity": {"kvTokensGPU": 440_000, "kvTokensHost": 1.5e6}}, None),  # not an integer
    ({"capacity": {"kvTokensGPU": True, "kvTokensHost": 10}}, None),
    ({"capacity": "x"}, None),
    ({}, None),
]


@pytest.mark.parametrize(("status", "tiers"), TIERS_TABLE)
def test_a_models_kv_tiers_come_from_its_status_capacity(status, tiers):
    item = {**_llmd("llama"), "status": status}
    slices = [_slice("llama", [("10.0.0.1", {"ready": True})])]
    targets = k8s.build_targets(
        k8s.parse_deployments([item]), slices, {}, None, None, k8s.tier_tokens([item])
    )
    assert targets["llama"].kv_tier_tokens == tiers


def test_a_static_model_may_give_its_decode_bound():
    models = parse({"models": [{"name": "a", "decodeTokensPerSecondBound": 143},
                               {"name": "b"}]})  # fmt: skip
    assert models["a"].decode_tokens_per_second_bound == 143.0
    assert models["b"].decode_tokens_per_second_bound is None
    for bad in (0, -1, float("inf"), 1e-320, 0.5, 1e9):  # 1-1e6 tokens/s, as routing takes
        with pytest.raises(StaticConfigError, match="decodeTokensPerSecondBound"):
            parse({"models": [{"name": "a", "decodeTokensPerSecondBound": bad}]})


async def test_watch_follows_the_api_server():
    """List, then watch events, against a scripted API server (httpx MockTransport)."""
    secret = {"data": {"token": base64.b64encode(b"sk-live").decode()}}
    deployment = _llmd(
        "llama",
        fallback={
            "url": "https://api.example.com/v1",
            "apiKeySecretRef": {"name": "fb", "key": "token"},
        },
    )
    deployment["status"]["capacity"] = {"decodeTokensPerSecondBound": 143.2}
    added = {"type": "ADDED", "object": _slice("llama", [("10.0.0.9", {"ready": True})])}
    watch_ended = asyncio.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        path, watch = request.url.path, request.url.params.get("watch")
        if path == "/api/v1/namespaces/ml/secrets/fb":
            return httpx.Response(200, json=secret)
        if path.endswith("/llmdeployments"):
            if watch:
                return httpx.Response(200, content=b"")
            return httpx.Response(
                200, json={"metadata": {"resourceVersion": "1"}, "items": [deployment]}
            )
        if path.endswith("/endpointslices"):
            if watch:
                watch_ended.set()
                return httpx.Response(200, content=(json.dumps(added) + "\n").encode())
            return httpx.Response(200, json={"metadata": {"resourceVersion": "1"}, "items": []})
        return httpx.Response(404)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="https://k8s")
    discovery = k8s.KubernetesDiscovery(kube.KubeConfig(server="https://k8s"), client=client)
    changes = []
    task = asyncio.create_task(discovery.run(lambda: changes.append(1)))
    try:
        async with asyncio.timeout(5):
            while not (
                discovery.snapshot().get("llama") and discovery.snapshot()["llama"].endpoints
            ):
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
    llama = discovery.snapshot()["llama"]
    assert [e.url for e in llama.routable] == ["http://10.0.0.9:8000"]
    assert llama.fallback.api_key == "sk-live"
    assert llama.decode_tokens_per_second_bound == 143.2  # the latency model's prior
    assert watch_ended.is_set() and changes
