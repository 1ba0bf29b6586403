"""KV-cache blocks as vLLM names and announces them: the block hash chain and the KV-event
wire format, shared by whoever publishes events (the simulated engine) and whoever
follows them (the gateway's precise prefix index). Pure, no I/O.

Block hashes (vLLM 0.32, vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py):

- Prompt tokens are cut into full blocks of `block_size` tokens (a partial tail is never
  cached). Block i's hash is `H((parent, tuple(block_i_token_ids), extra_keys))`, where
  `parent` is block i-1's hash and, for block 0, `NONE_HASH = H(seed)`; the chain means one
  hash names the whole prefix up to its block's end.
- `H` is `--prefix-caching-hash-algo`: `sha256` (the default: SHA-256 of the tuple's
  pickle, protocol 5) or `sha256_cbor` (SHA-256 of its canonical CBOR, language neutral).
  The seed is `PYTHONHASHSEED` when the engine has it set, else "vllm-none-hash" for these
  cryptographic algorithms (the xxhash ones use a random per-process seed unless
  PYTHONHASHSEED is set: nothing outside the engine can reproduce them, so they are refused).
- `extra_keys` (`generate_block_hash_extra_keys`) is None for a plain text request; a LoRA
  request adds `("lora", name, path)` to every block, then a `cache_salt` adds
  `("cache_salt", salt)` to block 0 only.
- KV events carry `int.from_bytes(hash, "big") & (2**64 - 1)` (the last 8 bytes) while
  `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` is 1, its default: `block_hashes` returns those.

Events (vllm/distributed/kv_events.py): a ZMQ PUB message is three frames, (topic, 8-byte
big-endian sequence number, msgpack payload); the payload is an `EventBatch`, encoded as
the array `[ts, [event, ...], data_parallel_rank]`; each event a msgpack map tagged by its
`type`: "BlockStored" (`block_hashes` in chain order, `parent_block_hash`, `token_ids`,
`block_size`, `lora_id`, `medium`, `lora_name`, ...), "BlockRemoved" (`block_hashes`,
`medium`) or "AllBlocksCleared". A replay request to the publisher's ROUTER socket is
(empty frame, 8-byte start sequence); it answers (empty, topic, seq, payload) per buffered
batch at or after the start, then (empty, empty, seq -1, empty).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256", "sha256_cbor")
MASK64 = (1 << 64) - 1
MAX_BLOCKS = 4096  # 4096 blocks x 16 tokens = 64 k tokens: longer prompts hash their head
END_SEQ = -1  # the replay socket's end marker
MEDIUM_GPU = "GPU"


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


def extra_keys(lora: tuple[str, str] | None = None) -> tuple[Any, ...] | None:
    """The per-block extra keys of a request run with adapter `lora` = (name, path)."""
    return (("lora", lora[0], lora[1]),) if lora else None


class BlockHasher:
    """Chained block hashes of token ids for one engine configuration."""

    def __init__(self, block_size: int, algo: str = "sha256", seed: str = DEFAULT_SEED) -> None:
        if block_size < 1:
            raise ValueError(f"block size {block_size}: must be at least 1")
        self.block_size = block_size
        self.algo = algo
        self._h = hash_function(algo)
        self.none_hash = self._h(seed)

    def block(
        self,
        parent: bytes | None,
        block: tuple[int, ...],
        keys: tuple[Any, ...] | None = None,
    ) -> bytes:
        """One block's hash after `parent` (None: the first block)."""
        return self._h((parent or self.none_hash, block, keys))

    def raw(
        self,
        token_ids: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
        cache_salt: str | None = None,
        max_blocks: int = MAX_BLOCKS,
        *,
        start: int = 0,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """The full vLLM block hashes (bytes) of the full blocks of `token_ids`, from block
        index `start` on (`parent`: the hash of block start - 1)."""
        size = self.block_size
        count = min(len(token_ids) // size, max_blocks)
        out: list[bytes] = []
        chain = parent or self.none_hash
        for i in range(start, count):
            keys = extra_keys
            if i == 0 and cache_salt:
                keys = (*(extra_keys or ()), ("cache_salt", cache_salt))
            block = tuple(map(int, token_ids[i * size : (i + 1) * size]))
            chain = self._h((chain, block, keys))
            out.append(chain)
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
        raw = self.raw(token_ids, extra_keys(lora), cache_salt, max_blocks)
        return tuple(external(h) for h in raw)


# ---------------------------------------------------------------------- events


def block_stored(
    hashes: Sequence[int],
    parent: int | None,
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    medium: str = MEDIUM_GPU,
) -> dict[str, Any]:
    """A BlockStored event as vLLM encodes it (its fields in order, defaults left out);
    `medium` is the tier holding the block: "GPU", or an offload tier's "CPU" / "STORAGE"."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
    }


def block_removed(hashes: Sequence[int], medium: str = MEDIUM_GPU) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[dict[str, Any]], rank: int = 0) -> bytes:
    """An EventBatch's msgpack payload (msgspec, vLLM's encoder)."""
    import msgspec

    return msgspec.msgpack.encode([ts, list(events), rank])


def decode_batch(payload: bytes) -> list[Any]:
    """A batch payload as plain values `[ts, [event, ...], rank]`."""
    import msgspec

    value = msgspec.msgpack.decode(payload)
    if not isinstance(value, list):
        raise ValueError("a KV event batch is a msgpack array")
    return value


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)
