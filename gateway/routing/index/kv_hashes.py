"""A prompt's KV-cache block hashes exactly as vLLM computes them and publishes them in its
KV events, so the gateway can look a prompt up in what each engine really holds.

The hashing itself (vLLM's chained SHA-256 blocks, the extra keys of LoRA and cache-salt
requests, the 64-bit event form) is the core's `kubellm.kv_blocks`, shared with the
simulated engine that publishes the same events; it is re-exported here.

Tokens come from the model's own tokenizer (`PromptTokenizer`): chat requests are
rendered with the model's chat template and the generation prompt, then encoded without
special tokens (vLLM's chat default); completion prompts are encoded with them (vLLM's
completion default); token-id prompts are used as given.
tests/gateway/routing/index/test_kv_hashes.py
checks the result against the BlockStored events of a real vLLM. For a fleet of simulated
engines, `--tokenizer MODEL=simulator` tokenizes as the simulator does (`SimPromptTokenizer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubellm.kv_blocks import (  # re-exported: the gateway's name for them
    DEFAULT_SEED,
    HASH_ALGOS,
    MASK64,
    MAX_BLOCKS,
    BlockHasher,
    external,
    hash_function,
)
from kubellm.sim_text import ApproxTokens, render_chat

__all__ = [
    "DEFAULT_SEED",
    "HASH_ALGOS",
    "MASK64",
    "MAX_BLOCKS",
    "BlockHasher",
    "PromptTokenizer",
    "SimPromptTokenizer",
    "external",
    "hash_function",
    "load_tokenizer",
]

SIMULATOR = "simulator"


class PromptTokenizer:
    """A model's own tokenizer and chat template (transformers), as vLLM applies them."""

    def __init__(self, path: str | Path, revision: str | None = None) -> None:
        from transformers import AutoTokenizer  # the gateway's `precise` extra

        self.path = str(path)
        self._tokenizer = AutoTokenizer.from_pretrained(self.path, revision=revision)

    def token_ids(self, body: dict[str, Any]) -> list[int] | None:
        """The prompt token ids vLLM computes for an OpenAI request body; None when the
        body is not one prompt the gateway can tokenize (a batch, images)."""
        messages = body.get("messages")
        if isinstance(messages, list):
            if any(
                not isinstance(m, dict) or not isinstance(m.get("content", ""), str)
                for m in messages
            ):
                return None
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            special = bool(body.get("add_special_tokens", False))
            return list(self._tokenizer.encode(text, add_special_tokens=special))
        prompt = body.get("prompt")
        special = bool(body.get("add_special_tokens", True))
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self._tokenizer.encode(prompt, add_special_tokens=special))
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        return None


class SimPromptTokenizer:
    """The simulated engine's tokenization (kubellm.sim_text), for precise routing over a
    fleet of simulators (`--tokenizer MODEL=simulator`): chat rendered with its template,
    text cut as it cuts it, token-id prompts as given."""

    path = SIMULATOR

    def __init__(self) -> None:
        self._tokens = ApproxTokens()

    def token_ids(self, body: dict[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if isinstance(messages, list):
            if not messages or any(
                not isinstance(m, dict) or not isinstance(m.get("role"), str) for m in messages
            ):
                return None
            return self._tokens.encode(render_chat(messages))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._tokens.encode(prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        return None


def load_tokenizer(
    path: str | Path, revision: str | None = None
) -> PromptTokenizer | SimPromptTokenizer:
    """The tokenizer `--tokenizer MODEL=PATH` names: `simulator`, or a model's own (a local
    directory, or a Hugging Face id at `revision`)."""
    return SimPromptTokenizer() if str(path) == SIMULATOR else PromptTokenizer(path, revision)
