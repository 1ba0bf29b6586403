"""The simulated replica's KV offload tiers: host memory, then disk (spec.engine.kvOffload).

What it copies from vLLM 0.32's OffloadingConnector (native CPU backend) and its
TieringOffloadingSpec (`fs` secondary tier):
- Write-through: every full block the GPU caches is stored to the host tier as it is
  computed (a block already there is only touched); the copy runs on its own DMA stream,
  beside the step, so it costs the step only what it takes beyond it (`store_s`).
- The host tier is an LRU of `host_blocks` blocks; a block it evicts moves to the disk
  tier (an LRU of `disk_blocks`) when there is one, else is gone.
- A request's prefix is looked up on the GPU first; where the GPU's chain stops, it goes
  on in the host tier, then on disk, block by block, until the first miss. Blocks found
  there are reloaded into new GPU blocks (and cached there: the GPU announces them) at
  bytes / bandwidth (disk: through host memory, both links). vLLM loads them
  asynchronously while the request waits; here the load is added to the step that admits
  the request (conservative for the tier: other requests in that step wait too).
- Hits are counted per tier (vLLM's `vllm:prefix_cache_hits` counts the GPU's; the
  connector's are `vllm:external_prefix_cache_hits`); bytes moved each way per tier.
- KV events: BlockStored / BlockRemoved with medium "CPU" or "STORAGE", as vLLM's
  OffloadingEventsTracker announces them (kubellm.kv_blocks encodes them byte-equal).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kubellm import kv_blocks, kv_tiers


@dataclass
class TierCounters:
    hits_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(kv_tiers.TIERS, 0))
    stored_blocks: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(kv_tiers.TIERS[1:], 0)
    )
    loaded_bytes: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(kv_tiers.TIERS[1:], 0)
    )
    stored_bytes: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(kv_tiers.TIERS[1:], 0)
    )


class OffloadTiers:
    """Host and disk LRUs of block hashes, with their transfer costs and events."""

    def __init__(
        self,
        block_bytes: int,
        host_blocks: int,
        disk_blocks: int = 0,
        *,
        host_gbps: float = kv_tiers.RELOAD_GBPS[kv_tiers.CPU],
        disk_read_gbps: float = kv_tiers.RELOAD_GBPS[kv_tiers.STORAGE],
        disk_write_gbps: float = kv_tiers.STORE_GBPS[kv_tiers.STORAGE],
        events: list[dict[str, Any]] | None = None,
    ) -> None:
        if block_bytes < 1 or host_blocks < 1 or disk_blocks < 0:
            raise ValueError("offload tiers need positive block bytes and a host tier")
        self.block_bytes = block_bytes
        self.capacity = {kv_tiers.CPU: host_blocks, kv_tiers.STORAGE: disk_blocks}
        self.lru: dict[str, collections.OrderedDict[bytes, None]] = {
            kv_tiers.CPU: collections.OrderedDict(),
            kv_tiers.STORAGE: collections.OrderedDict(),
        }
        self.host_gbps = host_gbps
        self.disk_read_gbps = disk_read_gbps
        self.disk_write_gbps = disk_write_gbps
        self.events = events
        self.counters = TierCounters()
        self.pending_store_s = 0.0  # stores issued since the last step ended

    def tier_of(self, block_hash: bytes) -> str | None:
        for tier in (kv_tiers.CPU, kv_tiers.STORAGE):
            if block_hash in self.lru[tier]:
                return tier
        return None

    def lookup(self, hashes: Sequence[bytes]) -> list[str]:
        """The tiers of the longest run of `hashes` held below the GPU, in order."""
        found: list[str] = []
        for block_hash in hashes:
            tier = self.tier_of(block_hash)
            if tier is None:
                break
            found.append(tier)
        return found

    def load(self, hashes: Sequence[bytes], tiers: Sequence[str]) -> float:
        """Reload these blocks into the GPU; returns the seconds it takes. A block read from
        disk is promoted to the host tier (it passes through it), as vLLM's tiering does."""
        seconds = 0.0
        for block_hash, tier in zip(hashes, tiers, strict=True):
            self.counters.hits_blocks[tier] += 1
            self.counters.loaded_bytes[tier] += self.block_bytes
            seconds += self.block_bytes / (self.host_gbps * 1e9)
            if tier == kv_tiers.STORAGE:
                seconds += self.block_bytes / (self.disk_read_gbps * 1e9)
                self._put(kv_tiers.CPU, block_hash, None)
            else:
                self.lru[tier].move_to_end(block_hash)
        return seconds

    def store(self, hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int],
              block_size: int, lora: str | None = None) -> None:  # fmt: skip
        """Write-through of newly computed GPU blocks (chain order) to the host tier."""
        new = []
        for index, block_hash in enumerate(hashes):
            if block_hash in self.lru[kv_tiers.CPU]:
                self.lru[kv_tiers.CPU].move_to_end(block_hash)
                continue
            prev = hashes[index - 1] if index else parent
            tokens = token_ids[index * block_size : (index + 1) * block_size]
            new.append((block_hash, prev, tokens))
        for block_hash, prev, tokens in new:
            self._put(kv_tiers.CPU, block_hash, (prev, tokens, block_size, lora))

    def _put(self, tier: str, block_hash: bytes, meta: Any) -> None:
        lru = self.lru[tier]
        if block_hash in lru:
            lru.move_to_end(block_hash)
            return
        capacity = self.capacity[tier]
        if capacity < 1:
            return
        while len(lru) >= capacity:
            victim, _ = lru.popitem(last=False)
            self._event(kv_blocks.block_removed([kv_blocks.external(victim)], tier))
            if tier == kv_tiers.CPU and self.capacity[kv_tiers.STORAGE]:
                self._put(kv_tiers.STORAGE, victim, None)
        lru[block_hash] = None
        self.counters.stored_blocks[tier] += 1
        self.counters.stored_bytes[tier] += self.block_bytes
        gbps = self.host_gbps if tier == kv_tiers.CPU else self.disk_write_gbps
        self.pending_store_s += self.block_bytes / (gbps * 1e9)
        if meta is None:  # a block moved between tiers: announced by its hash alone
            self._event(kv_blocks.block_stored([kv_blocks.external(block_hash)], None, [], 0,
                                               medium=tier))  # fmt: skip
        else:
            prev, tokens, size, lora = meta
            self._event(kv_blocks.block_stored(
                [kv_blocks.external(block_hash)],
                kv_blocks.external(prev) if prev is not None else None,
                tokens, size, lora, medium=tier,
            ))  # fmt: skip

    def _event(self, event: dict[str, Any]) -> None:
        if self.events is not None:
            self.events.append(event)

    def take_store_seconds(self) -> float:
        seconds, self.pending_store_s = self.pending_store_s, 0.0
        return seconds

    def clear(self) -> None:
        for lru in self.lru.values():
            lru.clear()


# vLLM 0.32's offload metrics (counters; prometheus_client adds `_total`): the connector's
# transfer counters (vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py),
# the external prefix-cache counters (vllm/v1/metrics/loggers.py) and the tiering spec's
# per-tier counters (vllm/v1/kv_offload/tiering/base.py, label `tier`).
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
LOAD_BYTES = "vllm:kv_offload_load_bytes"
STORE_BYTES = "vllm:kv_offload_store_bytes"
TIER_READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
TIER_WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"


def metric_values(
    tiers: OffloadTiers, external_queries: int, external_hits: int
) -> dict[tuple[str, str | None], float]:
    """(metric, tier label or None) -> the counter's value now."""
    c = tiers.counters
    return {
        (EXTERNAL_QUERIES, None): external_queries,
        (EXTERNAL_HITS, None): external_hits,
        (LOAD_BYTES, None): sum(c.loaded_bytes.values()),
        (STORE_BYTES, None): c.stored_bytes[kv_tiers.CPU],
        (TIER_READ_BYTES, "fs"): c.loaded_bytes[kv_tiers.STORAGE],
        (TIER_WRITE_BYTES, "fs"): c.stored_bytes[kv_tiers.STORAGE],
    }
