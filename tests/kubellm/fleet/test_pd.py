"""`kubellm up --engine sim` with spec.prefill: both roles run, and the real gateway splits
requests between them (the prefill leg on the prefill role, the decode leg carrying its
kv_transfer_params to the decode role, whose external prefix-cache hits grow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics
from tests.fixtures.engines import wait_until
from tests.fixtures.fleets import write_manifest

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


def _sample(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _ready(fleet: Any, key: str) -> list[dict[str, Any]]:
    state = fleet.state() or {"deployments": {"pd": {key: []}}}
    return [r for r in state["deployments"]["pd"][key] if r["state"] == "ready"]


def test_a_sim_fleet_with_spec_prefill_runs_both_roles_and_the_gateway_splits(
    start_fleet: Any, tmp_path: Path
) -> None:
    manifest = write_manifest(
        tmp_path / "pd.yaml",
        "pd",
        {
            "model": {"source": "file:///nonexistent/sim-only", "servedName": "pd"},
            "resources": {"gpu": {"count": 1}},
            "replicas": 1,
            "prefill": {"split": "Always", "replicas": 1},
        },
    )
    fleet = start_fleet(manifest, extra=("--sim-time-scale", "0.05"))
    wait_until(lambda: len(_ready(fleet, "replicas")) == 1, timeout=90, what="a decode replica")
    wait_until(lambda: len(_ready(fleet, "prefillReplicas")) == 1, timeout=90, what="a prefill one")
    decode = _ready(fleet, "replicas")[0]["url"]
    prefill = _ready(fleet, "prefillReplicas")[0]["url"]
    before = _sample(decode, EXTERNAL_HITS)
    prompts = 0
    for index in range(3):
        prompt = f"request {index}: " + "a long retrieved document about routing " * 60
        answer = httpx.post(
            f"{fleet.url}/v1/completions",
            json={"model": "pd", "prompt": prompt, "max_tokens": 16},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 16
        prompts += answer.json()["usage"]["prompt_tokens"]
    # every prompt came to decode over the connector; the prefill role computed them
    assert _sample(decode, EXTERNAL_HITS) - before == prompts
    assert _sample(prefill, "vllm:prompt_tokens_total") >= prompts
    assert _sample(fleet.url, metrics.GATEWAY_DISAGG_LEGS, role="prefill", outcome="ok") == 3
    assert _sample(fleet.url, metrics.GATEWAY_DISAGG_DECISIONS, split="true", reason="always") == 3
    pids = [r["pid"] for r in (fleet.state() or {})["deployments"]["pd"]["prefillReplicas"]]
    out = fleet.stop()
    assert fleet.process.returncode == 0, out
    assert "prefill role at 1 replica(s)" in out, out
    assert all(pid for pid in pids)


def _pd(**spec: Any) -> Any:
    from kubellm import manifests

    return manifests.parse({
        "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": "a"},
        "spec": {"model": {"source": "file:///m"}, "rollout": {"strategy": "Canary"}, **spec},
    })  # fmt: skip


async def test_the_local_runtime_runs_the_prefill_role_on_the_stable_revision(
    tmp_path: Path,
) -> None:
    from kubellm.fleet.processes import Supervisor
    from kubellm.fleet.runtime import LocalBackend, LocalRuntime

    supervisor = Supervisor(tmp_path / "logs")
    runtime = LocalRuntime(supervisor, tmp_path, engine="sim")
    prefill = {"replicas": 1, "autoscaling": {"maxReplicas": 3}}
    assert "a prefill role at 1 replica(s)" in runtime.apply([_pd(prefill=prefill)])
    assert supervisor.desired == {"a": 1, "a--prefill": 1}
    assert "--role" in (decode := supervisor.commands["a"](0, 1)) and "decode" in decode
    assert "prefill" in supervisor.commands["a--prefill"](0, 1)
    command = supervisor.commands["a--prefill"]
    # a canary revision: the prefill replicas keep the stable revision (no restart)
    changes = runtime.apply([_pd(prefill=prefill, model={"source": "file:///m2"})])
    assert any("starts as a canary" in c for c in changes)
    assert supervisor.commands["a--prefill"] is command
    # the autoscaler's write of spec.prefill.replicas
    backend = LocalBackend(runtime)
    (target,) = await backend.targets()
    assert target.prefill is not None and not target.scales_decode
    await backend.write_prefill_replicas(target, 3)
    assert supervisor.desired["a--prefill"] == 3
    assert runtime.apply([_pd(model={"source": "file:///m2"})])[-1] == "a prefill role removed"
    assert supervisor.desired["a--prefill"] == 0
