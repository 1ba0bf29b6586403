"""A prompt's KV-cache block hashes exactly as vLLM computes them and publishes them in its
KV events, so the gateway can look a prompt up in what each engine really holds.

What vLLM 0.32 does (vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py):

- Prompt tokens are cut into full blocks of `block_size` tokens (a partial tail is never
  cached). Block i's hash is `H((parent, tuple(block_i_token_ids), extra_keys))`, where
  `parent` is block i-1's hash and, for block 0, `NONE_HASH = H(seed)`; the chain means one
  hash names the whole prefix up to its block's end.
- `H` is `--prefix-caching-hash-algo`: `sha256` (the default: SHA-256 of the tuple's
  pickle, protocol 5) or `sha256_cbor` (SHA-256 of its canonical CBOR, language neutral).
  The seed is `PYTHONHASHSEED` when the engine has it set, else "vllm-none-hash" for these
  cryptographic algorithms (the xxhash ones use a random per-process seed unless
  PYTHONHASHSEED is set: nothing outside the engine can reproduce them, so they are refused).
- `extra_keys` is None for a plain text request; a LoRA request adds
  `("lora", name, path)` to every block, a `cache_salt` adds `("cache_salt", salt)` to
  block 0 only.
- KV events carry `int.from_bytes(hash, "big") & (2**64 - 1)` (the last 8 bytes) while
  `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` is 1, its default: `block_hashes` returns those.

Tokens come from the model's own tokenizer (`PromptTokenizer`): chat requests are
rendered with the model's chat template and the generation prompt, then encoded without
special tokens (vLLM's chat default); completion prompts are encoded with them (vLLM's
completion default); token-id prompts are used as given. tests/gateway/test_kv_hashes.py
checks the result against the BlockStored events of a real vLLM.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256", "sha256_cbor")
MASK64 = (1 << 64) - 1
MAX_BLOCKS = 4096  # 4096 blocks x 16 tokens = 64 k tokens: longer prompts hash their head


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # a vLLM dependency; only needed for engines run with sha256_cbor

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's `--prefix-caching-hash-algo` by name; ValueError naming the field otherwise."""
    if algo == "sha256":
        return _sha256_pickle
    if algo == "sha256_cbor":
        return _sha256_cbor
    raise ValueError(
        f"prefix-caching hash algorithm {algo!r}: the gateway reproduces only "
        f"{', '.join(HASH_ALGOS)} (vLLM seeds the xxhash ones randomly per process)"
    )


def external(block_hash: bytes) -> int:
    """The block hash as vLLM's KV events carry it: its last 64 bits as an int."""
    return int.from_bytes(block_hash, "big") & MASK64


class BlockHasher:
    """Chained block hashes of token ids for one engine configuration."""

    def __init__(self, block_size: int, algo: str = "sha256", seed: str = DEFAULT_SEED) -> None:
        if block_size < 1:
            raise ValueError(f"block size {block_size}: must be at least 1")
        self.block_size = block_size
        self.algo = algo
        self._h = hash_function(algo)
        self.none_hash = self._h(seed)

    def raw(
        self,
        token_ids: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
        cache_salt: str | None = None,
        max_blocks: int = MAX_BLOCKS,
    ) -> list[bytes]:
        """The full vLLM block hashes (bytes) of the full blocks of `token_ids`."""
        size = self.block_size
        count = min(len(token_ids) // size, max_blocks)
        out: list[bytes] = []
        parent = self.none_hash
        for i in range(count):
            keys = extra_keys
            if i == 0 and cache_salt:
                keys = (*(extra_keys or ()), ("cache_salt", cache_salt))
            block = tuple(int(t) for t in token_ids[i * size : (i + 1) * size])
            parent = self._h((parent, block, keys))
            out.append(parent)
        return out

    def block_hashes(
        self,
        token_ids: Sequence[int],
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
        max_blocks: int = MAX_BLOCKS,
    ) -> tuple[int, ...]:
        """The 64-bit hashes vLLM's KV events publish for a prompt of `token_ids`.

        `lora` is the adapter's (name, path) as the engine loaded it."""
        extra = (("lora", lora[0], lora[1]),) if lora else None
        return tuple(external(h) for h in self.raw(token_ids, extra, cache_salt, max_blocks))


class PromptTokenizer:
    """A model's own tokenizer and chat template (transformers), as vLLM applies them."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer  # the gateway's `precise` extra

        self.path = str(path)
        self._tokenizer = AutoTokenizer.from_pretrained(self.path)

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
