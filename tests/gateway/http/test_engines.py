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


def test_a_non_streamed_answer_through_the_gateway_is_the_simulators_whole_answer(
    sim_server, gateway
):
    """The gateway sends a non-streamed request to the replica as a stream and assembles
    the answer (tests/gateway/http/test_assembled.py): what the client gets is what the
    simulator answers whole (its text depends on the prompt only)."""
    url = sim_server(served_model_name="tiny", profile="tiny-cpu")
    gw = gateway({"tiny": model("tiny", [url])})
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    completion = {"model": "tiny", "prompt": "the cat sat on", "max_tokens": 5}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        whole = httpx.post(f"{url}{path}", json=body, timeout=10).json()
        answer = httpx.post(f"{gw.url}{path}", json=body, timeout=10).json()
        assert answer["choices"] == whole["choices"]
        assert answer["usage"] == whole["usage"] and answer["object"] == whole["object"]
        assert answer["model"] == whole["model"]


@pytest.mark.vllm
def test_gateway_in_front_of_real_vllm(vllm_server, gateway):
    gw = gateway({"tiny": model("tiny", [vllm_server])})
    client = gw.client(timeout=120)
    answer = client.completions.create(model="tiny", prompt="the cat sat on", max_tokens=4)
    assert answer.usage.completion_tokens >= 1
    # Non-streamed, both ways the gateway forwards it: whole (the default for a replica whose
    # token counters it scrapes, as vLLM's) and assembled from vLLM's stream (forced here):
    # either is the answer vLLM gives whole (greedy: the same tokens).
    assembling = gateway({"tiny": model("tiny", [vllm_server])}, assemble_non_streamed=True)
    for url, path, body in (
        (gw.url, "/v1/completions", {"prompt": "the cat sat on", "logprobs": 1}),
        (gw.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "the dog"}]}),
        (assembling.url, "/v1/completions", {"prompt": "the cat sat on", "logprobs": 1}),
        (assembling.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        body = {**body, "model": "tiny", "max_tokens": 6, "temperature": 0}
        whole = httpx.post(f"{vllm_server}{path}", json=body, timeout=120).json()
        assembled = httpx.post(f"{url}{path}", json=body, timeout=120).json()
        # a stream's usage event leaves out the null details the whole answer carries
        assert {k: v for k, v in assembled["usage"].items() if v is not None} == {
            k: v for k, v in whole["usage"].items() if v is not None
        }
        for mine, theirs in zip(assembled["choices"], whole["choices"], strict=True):
            assert mine["finish_reason"] == theirs["finish_reason"]
            if "text" in theirs:
                assert mine["text"] == theirs["text"]
                assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
                assert mine["logprobs"]["text_offset"] == theirs["logprobs"]["text_offset"]
            else:
                assert mine["message"]["content"] == theirs["message"]["content"]
    stream = client.completions.create(
        model="tiny", prompt="the dog ran", max_tokens=4, stream=True
    )
    assert len([c for c in stream if c.choices]) >= 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="absent", prompt="x", max_tokens=1)
