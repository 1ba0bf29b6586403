"""One API and metrics suite, run against the real vLLM CPU engine and the simulator.

The simulator is configured like the vLLM fixture (tiny checkpoint's tokenizer,
block size 32), so the same assertions hold for both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics
from tests.fixtures.engines import TINY_BLOCK_SIZE

MODEL = "tiny"
NO_EOS = {"ignore_eos": True}  # random weights may emit EOS at once; the sim ignores it


@dataclass
class Engine:
    kind: str
    url: str

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(params=["sim", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Engine:
    if request.param == "vllm":
        return Engine("vllm", request.getfixturevalue("vllm_server"))
    start: Callable[..., str] = request.getfixturevalue("sim_server")
    url = start(MODEL, "tiny-cpu", 0.0, tokenizer_dir=str(tiny_model_dir))
    return Engine("sim", url)


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (labels dropped, one engine per server)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def test_models_lists_the_served_name(engine: Engine) -> None:
    names = [model.id for model in engine.client.models.list().data]
    assert names == [MODEL]


def test_health(engine: Engine) -> None:
    assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200


def test_completion(engine: Engine) -> None:
    result = engine.client.completions.create(
        model=MODEL, prompt="The cluster is", max_tokens=6, extra_body=NO_EOS
    )
    assert result.choices[0].finish_reason == "length"
    assert result.choices[0].text
    assert result.usage is not None and result.usage.completion_tokens == 6


def test_chat_completion(engine: Engine) -> None:
    result = engine.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=5,
        extra_body=NO_EOS,
    )  # fmt: skip
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content
    assert result.choices[0].finish_reason == "length"


def test_streaming_completion_arrives_in_pieces(engine: Engine) -> None:
    stream = engine.client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=8, stream=True, extra_body=NO_EOS
    )
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2
    assert chunks[-1].choices[0].finish_reason == "length"


def test_streaming_chat_arrives_in_pieces(engine: Engine) -> None:
    stream = engine.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=8,
        stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS,
    )  # fmt: skip
    chunks = list(stream)
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) >= 2
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_metrics_carry_the_contract(engine: Engine) -> None:
    engine.client.completions.create(model=MODEL, prompt="warm up", max_tokens=3, extra_body=NO_EOS)
    samples = scrape(engine.url)
    for name in metrics.ENGINE_METRICS:
        histogram = name in (
            metrics.TIME_TO_FIRST_TOKEN, metrics.INTER_TOKEN_LATENCY, metrics.PREFILL_TIME
        )  # fmt: skip
        assert (f"{name}_count" if histogram else name) in samples, name
    assert samples[f"{metrics.TIME_TO_FIRST_TOKEN}_count"] >= 1
    assert samples[f"{metrics.INTER_TOKEN_LATENCY}_count"] >= 2
    assert samples[f"{metrics.PREFILL_TIME}_count"] >= 1  # observed at the request's end
    assert 0.0 <= samples[metrics.KV_CACHE_USAGE] <= 1.0


def test_repeated_long_prefix_hits_the_prefix_cache(engine: Engine) -> None:
    prompt = (
        "Prefix caching check for the "
        + engine.kind
        + " engine. "
        + "The cluster is healthy. " * 30
    )
    before = scrape(engine.url)
    engine.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=NO_EOS)
    middle = scrape(engine.url)
    engine.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=NO_EOS)
    after = scrape(engine.url)
    hits, queries = metrics.PREFIX_CACHE_HITS, metrics.PREFIX_CACHE_QUERIES
    assert middle[hits] == before[hits]  # first time: nothing cached
    prompt_tokens = after[queries] - middle[queries]
    assert prompt_tokens > 4 * TINY_BLOCK_SIZE
    # second time: every full block but the one holding the last token is a hit
    assert after[hits] - middle[hits] == (prompt_tokens - 1) // TINY_BLOCK_SIZE * TINY_BLOCK_SIZE


def test_bad_max_tokens_gets_a_400_in_openais_envelope(engine: Engine) -> None:
    response = httpx.post(
        f"{engine.url}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": -1},
        timeout=30,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert "max_tokens" in error["message"]


def test_too_long_request_gets_a_400(engine: Engine) -> None:
    with pytest.raises(openai.BadRequestError):
        engine.client.completions.create(model=MODEL, prompt="hi", max_tokens=5000)


def test_unknown_model_gets_a_404(engine: Engine) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        engine.client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "no-such-model" in str(caught.value)
