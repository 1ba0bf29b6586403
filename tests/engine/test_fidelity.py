"""Fidelity: the simulator's prefix cache counts match real vLLM's on the same requests.

The same shared-prefix mix (4 long "system prompts" x 5 questions, interleaved,
sent one at a time) goes to the vLLM CPU server and to a simulator using the
tiny checkpoint's tokenizer and vLLM's block size. Hits and queries must agree
within 10%. Run with `-s` to see the figures.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from kubellm.engine.corpus import CORPUS

from kubellm import metrics
from tests.engine.test_engine_api import MODEL, scrape

pytestmark = pytest.mark.vllm

QUESTIONS = ("What is prefill?", "Why batch?", "What is a block?", "Who waits?", "Why route?")


def shared_prefix_mix() -> list[str]:
    paragraphs = [p.replace("\n", " ") for p in CORPUS.split("\n\n")][:4]
    return [
        f"Fidelity run. Context {index}: {paragraphs[index]}\nQuestion: {question}\nAnswer:"
        for question in QUESTIONS
        for index in range(len(paragraphs))
    ]


def prefix_counts(url: str, prompts: list[str]) -> tuple[float, float]:
    before = scrape(url)
    with httpx.Client(base_url=url, timeout=60) as client:
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            client.post("/v1/completions", json=body).raise_for_status()
    after = scrape(url)
    return (
        after[metrics.PREFIX_CACHE_HITS] - before[metrics.PREFIX_CACHE_HITS],
        after[metrics.PREFIX_CACHE_QUERIES] - before[metrics.PREFIX_CACHE_QUERIES],
    )


def test_simulator_prefix_cache_counts_match_vllm(
    vllm_server: str, sim_server: Callable[..., str], tiny_model_dir: Path
) -> None:
    prompts = shared_prefix_mix()
    real_hits, real_queries = prefix_counts(vllm_server, prompts)
    sim = sim_server(MODEL, "tiny-cpu", 0.0, tokenizer_dir=str(tiny_model_dir))
    sim_hits, sim_queries = prefix_counts(sim, prompts)
    print(f"\nfidelity ({len(prompts)} requests): vLLM hits {real_hits:.0f} / queries "
          f"{real_queries:.0f} ({real_hits / real_queries:.1%}); simulator hits {sim_hits:.0f} / "
          f"queries {sim_queries:.0f} ({sim_hits / sim_queries:.1%})")  # fmt: skip
    assert real_hits > 0.3 * real_queries  # the mix really shares prefixes
    assert sim_queries == pytest.approx(real_queries, rel=0.10)
    assert sim_hits == pytest.approx(real_hits, rel=0.10)
