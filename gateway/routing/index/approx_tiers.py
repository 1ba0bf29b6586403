"""The approximate prefix index's model of a replica's tiers, when the replica runs a host
tier (spec.engine.kvOffload; status.capacity.kvTokensGPU / kvTokensHost).

The approximate index (scorers/prefix.py) remembers, per replica, the chunk-hash chains
this front end sent there, most recent last. Without a tier it is one LRU as long as its
`capacity` (a chunk lives or dies there). With a host tier, vLLM's write-through LRU
keeps the last `host` chunks' worth of blocks in host memory, of which the last `gpu`
are also on the GPU: so the index keeps two segments, the GPU's (the last `gpu` chunks
sent) and, below it, the chunks the GPU evicted that the host tier still holds (the next
`host - gpu`), each an LRU. A chunk sent again moves back up (vLLM reloads it into the
GPU); one pushed past the host tier is forgotten. A prefix is matched as vLLM looks it
up: the GPU's run first, then the host tier continues it until the first miss; a host
chunk counts at the host tier's worth (kv_tiers.DEFAULT_VALUE: 0.92 of a GPU hit).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

CHARS_PER_TOKEN = 4  # the approximate index's chunks are characters; ~4 to a token


@dataclass(frozen=True)
class ChunkTiers:
    """One replica's tiers in chunks: the GPU pool's, and the host tier's (which holds the
    GPU's too: write-through)."""

    gpu: int
    host: int

    @classmethod
    def from_tokens(cls, gpu_tokens: int, host_tokens: int, chunk_chars: int) -> ChunkTiers:
        if gpu_tokens < 1 or host_tokens < 0 or chunk_chars < 1:
            raise ValueError("tier capacities need a positive GPU pool and chunk size")
        per_chunk = max(1, chunk_chars // CHARS_PER_TOKEN)
        return cls(max(1, gpu_tokens // per_chunk), host_tokens // per_chunk)

    @property
    def below(self) -> int:
        """Chunks held in the host tier only (the GPU evicted them)."""
        return max(0, self.host - self.gpu)


def spill(gpu: OrderedDict[int, float], host: OrderedDict[int, float], tiers: ChunkTiers) -> None:
    """Move the GPU segment's oldest chunks past its size down into the host segment (as
    its newest), and forget the host segment's oldest past its own."""
    while len(gpu) > tiers.gpu:
        h, sent = gpu.popitem(last=False)
        if tiers.below:
            host[h] = sent
    while len(host) > tiers.below:
        host.popitem(last=False)


def matched_by_tier(
    gpu: OrderedDict[int, float], host: OrderedDict[int, float], hashes: Sequence[int]
) -> tuple[int, int]:
    """(GPU, host) chunks of the chain's longest held prefix: the GPU's run, then the host
    tier's continuation until the first miss (a GPU chunk there counts as the host's: the
    host tier holds a copy of every GPU block)."""
    on_gpu = 0
    while on_gpu < len(hashes) and hashes[on_gpu] in gpu:
        on_gpu += 1
    below = 0
    for h in hashes[on_gpu:]:
        if h not in host and h not in gpu:
            break
        below += 1
    return on_gpu, below
