"""The shadow step in Inference Extension mode, through a real Envoy: Envoy sends each
request to the one endpoint the picker names, so the picker (which holds the body) issues
the mirrored pair itself, with the gateway's mirror (routing/mirror.py). The client never
sees a canary answer, the mirror is counted apart from requests, and quotas are untouched."""

from __future__ import annotations

import httpx
from kubellm.gateway.routing.flow import tenants

from kubellm import metrics
from tests.fixtures.engines import wait_until

SHADOW = {"canaryRevision": "r2", "phase": "Progressing", "canaryWeight": 0,
          "shadow": {"share": 1.0, "maxConcurrency": 4, "firstTokens": 4}}  # fmt: skip


def _successes(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:request_success_total")  # fmt: skip


def _stack(envoy_stack, sims, tmp_path, **model):
    (stable,), (canary,) = sims(1), sims(1)
    doc = {"tenants": [{"name": "meter", "requestsPerMinute": 2,
                        "apiKeys": [f"sha256:{tenants.digest('sk-meter')}"]}]}  # fmt: skip
    (tmp_path / "tenants.yaml").write_text(__import__("yaml").safe_dump(doc))
    endpoints = [stable, {"url": canary, "revision": "r2"}]
    stack = envoy_stack([{"name": "tiny", "endpoints": endpoints, "rollout": SHADOW, **model}],
                        epp_args=("--tenants", str(tmp_path / "tenants.yaml")))  # fmt: skip
    return stack, stable, canary


def _settled(stack, count: int) -> None:
    wait_until(lambda: stack.metric(metrics.GATEWAY_MIRROR_REQUESTS)
               + stack.metric(metrics.GATEWAY_MIRROR_SHED) >= count, 60,
               "every mirror compared or shed")  # fmt: skip


def test_the_picker_mirrors_and_the_client_never_sees_the_canary(envoy_stack, sims, tmp_path):
    stack, stable, canary = _stack(envoy_stack, sims, tmp_path)
    headers = {"authorization": "Bearer sk-meter"}
    for i in range(2):  # the tenant's whole quota
        body = {"model": "tiny", "prompt": f"Mirror question {i} " * 10, "max_tokens": 4}
        answer = httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
    _settled(stack, 2)
    compared = stack.metric(metrics.GATEWAY_MIRROR_REQUESTS, revision="r2")
    assert compared >= 1
    # the canary answered mirrors only; stable the clients' requests and its mirror halves
    assert _successes(canary) == compared
    assert _successes(stable) == 2 + compared
    # counted apart: two requests, both the tenant's, none throttled
    assert stack.metric("kubellm_gateway_requests_total") == 2
    assert stack.metric("kubellm_gateway_tenant_requests_total", tenant="meter") == 2
    assert stack.metric("kubellm_gateway_tenant_throttled_total", tenant="meter") == 0
