"""Real vLLM (CPU) serves a LoRA adapter of the tiny checkpoint through the gateway.

The adapter is trained locally (kubellm.engine.tiny_lora: a few seeded steps, PEFT's file
format). vLLM starts with it (the launcher's --lora-modules); a second adapter that only
the gateway's model lists is loaded at runtime through vLLM's /v1/load_lora_adapter when
the first request names it. Greedy answers to one prompt differ between the base model
and the adapter.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import httpx
import pytest
from kubellm.engine import tiny_lora
from kubellm.gateway.discovery.base import AdapterRef

from kubellm import metrics
from kubellm.api import SLO
from tests.fixtures.engines import running_vllm, tiny_spec
from tests.gateway.conftest import model

pytestmark = pytest.mark.vllm

PROMPT = [{"role": "user", "content": "What does kubellm do?"}]


def _answer(url: str, name: str) -> httpx.Response:
    body = {"model": name, "messages": PROMPT, "max_tokens": 16, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_an_adapter_answers_differently_from_the_base_model_through_the_gateway(
    tiny_model_dir: Path, tmp_path: Path, gateway
) -> None:
    first = tiny_lora.build(tmp_path / "tiny-lora", tiny_model_dir)
    second = shutil.copytree(first, tmp_path / "tiny-lora-2")
    spec = tiny_spec(tiny_model_dir)
    spec["adapters"] = [{"name": "tiny-lora", "source": f"file://{first}"}]
    spec["engine"] |= {"maxLoras": 2, "maxLoraRank": tiny_lora.RANK}
    with running_vllm(spec, tmp_path) as engine:
        refs = (AdapterRef("tiny-lora", str(first)), AdapterRef("tiny-lora-2", str(second)))
        # a TTFT budget that covers loading an adapter on this CPU (no fallback to take over)
        slo = SLO(ttft_seconds=60)
        target = dataclasses.replace(model("tiny", [engine], slo=slo), adapters=refs)
        handle = gateway({"tiny": target})

        base = _answer(handle.url, "tiny")
        adapted = _answer(handle.url, "tiny-lora")
        assert base.status_code == adapted.status_code == 200, (base.text, adapted.text)
        assert adapted.json()["model"] == "tiny-lora"
        base_text = base.json()["choices"][0]["message"]["content"]
        adapted_text = adapted.json()["choices"][0]["message"]["content"]
        assert base_text != adapted_text, base_text

        runtime = _answer(handle.url, "tiny-lora-2")  # vLLM did not start with it
        labels = {"model": "tiny", "deployment": "tiny", "namespace": "default",
                  "adapter": "tiny-lora-2"}  # fmt: skip
        outcomes = {o: handle.metric(metrics.GATEWAY_ADAPTER_LOADS, **labels, outcome=o)
                    for o in ("ok", "error", "timeout")}  # fmt: skip
        assert runtime.status_code == 200, (runtime.text, outcomes)
        assert runtime.json()["choices"][0]["message"]["content"] == adapted_text  # same weights
        assert handle.metric(metrics.GATEWAY_ADAPTER_LOADS, **labels, outcome="ok") == 1
        cards = httpx.get(f"{engine}/v1/models", timeout=10).json()["data"]
        assert {c["id"] for c in cards} == {"tiny", "tiny-lora", "tiny-lora-2"}
