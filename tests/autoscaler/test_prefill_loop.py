"""The prefill role in the control loop (spec.prefill.autoscaling), against the Kubernetes
API emulator and /metrics endpoints on loopback: its replicas' queued prompt work against
the TTFT budget sets spec.prefill.replicas; the decode role counts only its own replicas."""

from __future__ import annotations

from typing import Any

from kubellm.autoscaler.kube_backend import KubernetesBackend
from kubellm.autoscaler.loop import Autoscaler

from kubellm import metrics
from kubellm.contracts import PREFILL_ROLE, ROLE_LABEL
from tests.autoscaler.conftest import LLMD, SLICES, endpoint_slice, engine_text, llmd
from tests.autoscaler.test_loop import Clock, clients, events, obj, scale_writes

__all__ = ["clients"]


def prefill_text(waiting: float, running: float, prompt_tokens: float, requests: float) -> str:
    """A prefill replica's gauges and vLLM's prompt-token and finished-request counters."""
    return engine_text(waiting, running, 0.5) + (
        f"# TYPE {metrics.PROMPT_TOKENS.removesuffix('_total')} counter\n"
        f'{metrics.PROMPT_TOKENS}{{model_name="tiny"}} {prompt_tokens}\n'
        "# TYPE vllm:request_success counter\n"
        f'vllm:request_success_total{{model_name="tiny",finished_reason="length"}} {requests}\n'
    )


def prefill_writes(cluster: Any) -> list[int]:
    return [
        r.data["spec"]["prefill"]["replicas"]
        for r in cluster
        if r.method == "PATCH" and r.resource is not None and r.subresource is None
        and "spec" in (r.data or {})
    ]  # fmt: skip


async def test_queued_prefill_work_scales_the_prefill_role_and_a_lower_ask_waits_its_window(
    cluster: Any, clients: Any, metrics_server: Any
) -> None:
    deployment = llmd(replicas=1, minReplicas=1, maxReplicas=4)
    deployment["spec"]["slo"] = {"ttftSeconds": 2.0}
    deployment["spec"]["prefill"] = {
        "replicas": 1,
        "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetQueueShare": 0.5,
                        "scaleDownStabilizationSeconds": 60},
    }  # fmt: skip
    cluster.objects[LLMD, "default", "tiny"] = deployment
    decode = await metrics_server(engine_text(0, 1, 0.2))
    cluster.objects[SLICES, "default", "tiny-a"] = endpoint_slice("tiny", decode.port, [True])
    prefill = await metrics_server(prefill_text(20, 2, 10_000, 10))
    prefill_slice = endpoint_slice("tiny", prefill.port, [True], "p")
    prefill_slice["metadata"]["labels"] = {
        "kubellm.io/deployment": "tiny",
        ROLE_LABEL: PREFILL_ROLE,
    }
    cluster.objects[SLICES, "default", "tiny-p"] = prefill_slice
    clock = Clock()
    api_client, scrape_client = clients
    loop = Autoscaler(KubernetesBackend(api_client), scrape_client, clock=clock)

    [outcome] = await loop.step()
    # the decode role's policy sees its own replica only, not the prefill one
    assert [r.name for r in outcome.observation.replicas] == ["tiny-a-0"]
    status = obj(cluster)["status"]["autoscaler"]["prefill"]
    assert status["reason"] == "NoThroughputYet" and prefill_writes(cluster) == []

    # 5 s later, still saturated: 50,000 prompt tokens in 5 s = 10,000 tokens/s learned; 22
    # prompts of 1,000 tokens are 2.2 s of work against 0.5 x 2 s per replica: 3 replicas
    prefill.text = prefill_text(20, 2, 60_000, 60)
    clock.now += 5
    await loop.step()
    assert prefill_writes(cluster) == [3]
    assert obj(cluster)["spec"]["prefill"]["replicas"] == 3
    status = obj(cluster)["status"]["autoscaler"]["prefill"]
    assert status["reason"] == "QueuedPrefillWork" and status["tokensPerSecond"] == 10_000
    assert any(e["reason"] == "QueuedPrefillWork" for e in events(cluster))
    assert scale_writes(cluster) == []  # the decode role stays where it was
    high_at = clock.now

    # the queue is gone: the lower ask holds for the window, then the role goes to its minimum
    prefill.text = prefill_text(0, 0, 80_000, 80)
    reasons = []
    while prefill_writes(cluster)[1:] == [] and clock.now < high_at + 120:
        clock.now += 5
        await loop.step()
        reasons.append(obj(cluster)["status"]["autoscaler"]["prefill"]["reason"])
    assert prefill_writes(cluster) == [3, 1]
    assert clock.now == high_at + 65  # the first period past the 60 s window
    assert set(reasons[:-1]) == {"ScaleDownHeld"}


async def test_prefill_autoscaling_alone_scales_the_prefill_role_only(
    cluster: Any, clients: Any, metrics_server: Any
) -> None:
    deployment = llmd(replicas=0)
    del deployment["spec"]["autoscaling"]
    deployment["spec"]["prefill"] = {"replicas": 2, "autoscaling": {"minReplicas": 1}}
    cluster.objects[LLMD, "default", "tiny"] = deployment
    api_client, scrape_client = clients
    loop = Autoscaler(KubernetesBackend(api_client), scrape_client, clock=Clock())
    assert await loop.step() == []  # no decode decision: spec.autoscaling is off
    # decode has no replica (spec.replicas 0): a prefill replica alone serves nothing
    assert prefill_writes(cluster) == [0] and scale_writes(cluster) == []
    assert obj(cluster)["status"]["autoscaler"]["prefill"]["reason"] == "PairAtZero"
