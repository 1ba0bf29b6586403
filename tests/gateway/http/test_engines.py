"""The gateway in front of the project's engines: the simulator, and real vLLM on CPU."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics
from tests.gateway.conftest import model


def _counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


def test_prefix_aware_routing_hits_the_simulators_prefix_cache(sim_server, gateway):
    urls = [sim_server(served_model_name="tiny", profile="tiny-cpu") for _ in range(2)]
    gw = gateway({"tiny": model("tiny", urls)})
    client = gw.client()
    system = "You answer questions about Kubernetes operators and their controllers. " * 12
    for i in range(4):
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
            max_tokens=4,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    queries = [_counter(u, metrics.PREFIX_CACHE_QUERIES) for u in urls]
    hits = [_counter(u, metrics.PREFIX_CACHE_HITS) for u in urls]
    assert sorted(q > 0 for q in queries) == [False, True]  # one replica took the prefix
    assert sum(hits) / sum(queries) > 0.5  # and its cache served most of the prompts


@pytest.mark.vllm
def test_gateway_in_front_of_real_vllm(vllm_server, gateway):
    gw = gateway({"tiny": model("tiny", [vllm_server])})
    client = gw.client(timeout=120)
    answer = client.completions.create(model="tiny", prompt="the cat sat on", max_tokens=4)
    assert answer.usage.completion_tokens >= 1
    stream = client.completions.create(
        model="tiny", prompt="the dog ran", max_tokens=4, stream=True
    )
    assert len([c for c in stream if c.choices]) >= 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="absent", prompt="x", max_tokens=1)
