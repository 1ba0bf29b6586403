"""Hardware/model profiles for the simulated engine.

A profile fixes one replica's KV pool (blocks x block size), its batching
limits and its step-time model:

    step seconds = step_base_s + prefill_token_s x prefill tokens
                   + decode_token_s x decode tokens

`llama-3.1-8b-h100` is derived from the capacity arithmetic in kubellm.capacity
and public figures:
- weights: Llama 3.1 8B in bf16, 16.06 GB; KV per token 2 x 32 layers x 8 KV
  heads x 128 x 2 B = 128 KiB (kubellm.capacity.known_model("llama-3.1-8b")).
- GPU: H100 SXM 80 GB, 3.35 TB/s HBM3, 989 TFLOPS dense bf16 (NVIDIA H100
  datasheet). KV pool = 80 GiB x 0.9 - weights = 57 GiB = about 29,000 blocks
  of 16 tokens.
- step base: one decode step streams all weights: 16.06 GB / 3.35 TB/s = 4.8 ms;
  at ~70% achieved bandwidth, 7 ms (vLLM's published 8B ITL at low batch is
  7-10 ms on H100).
- prefill: 2 x 8.03e9 FLOP per token at ~50% of 989 TFLOPS = 32 us per token.
- decode: each running sequence also reads its own KV (2,000 tokens x 128 KiB
  = 262 MB at 3.35 TB/s = 0.08 ms); 0.08 ms per decode token.

`tiny-cpu` mirrors the tiny checkpoint on vLLM's CPU backend here (block size
32, 1 GiB KV space, 1 KiB of KV per token). Step costs from
bench/engine_batching.py on a 2-core machine: 512 output tok/s at 1 stream
(~1.9 ms per step) and 5,248 tok/s at 32 streams (~6.1 ms per step), so
1.8 ms per step + 0.13 ms per decode token; prefill cost is a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kubellm import capacity


@dataclass(frozen=True)
class Profile:
    name: str
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    step_base_s: float
    prefill_token_s: float
    decode_token_s: float
    chunked_prefill: bool = True
    prefix_caching: bool = True
    source: str = ""

    def step_seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        return (
            self.step_base_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_token_s * decode_tokens
        )

    def with_overrides(self, **changes: int | float | bool | None) -> Profile:
        """A copy with the given fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _h100_8b() -> Profile:
    shape = capacity.known_model("llama-3.1-8b")
    weights = capacity.weight_bytes(shape.params, "bf16")
    per_token = capacity.kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, 2)
    pool = capacity.kv_pool_bytes(80 * capacity.GIB, 0.9, weights)
    block_size = 16
    return Profile(
        name="llama-3.1-8b-h100",
        block_size=block_size,
        num_blocks=pool // (per_token * block_size),
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        step_base_s=0.007,
        prefill_token_s=32e-6,
        decode_token_s=80e-6,
        source="kubellm.capacity + NVIDIA H100 SXM datasheet (3.35 TB/s, 989 TFLOPS bf16)",
    )


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        _h100_8b(),
        Profile(
            name="tiny-cpu",
            block_size=32,  # vLLM's CPU attention needs a multiple of 32
            num_blocks=(1 * capacity.GIB) // (2 * 2 * 1 * 64 * 4 * 32),
            max_num_seqs=16,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            step_base_s=0.0018,
            prefill_token_s=20e-6,
            decode_token_s=0.13e-3,
            source="the tiny checkpoint on vLLM CPU (bench/engine_batching.py)",
        ),
    )
}


def get(name: str) -> Profile:
    """The profile called `name`; ValueError naming --profile and the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"--profile {name!r} is unknown; known profiles: {', '.join(sorted(PROFILES))}"
        ) from None
