"""Which offload tier holds each block of each replica, from its KV events, and what a
prefix found there is worth.

vLLM's offloading connector announces its own tiers' blocks on the same event stream as
the GPU's: BlockStored / BlockRemoved with `medium` "CPU" (the host-memory tier) or
"STORAGE" (a file-system tier). A block moved down a tier is a removal from one and a
store into the next. `LowerTiers` keeps, per replica slot of a `kv_index.KVIndex`, the
hash -> tiers bitmask of those blocks (the GPU's stay in the KVIndex's own map), bounded
per replica as the KVIndex is; a replica's restart or departure clears them
(AllBlocksCleared is the GPU's reset_prefix_cache: offloaded blocks stay).

`TierValue` is what a block found in a tier saves, as a share of the prefill it avoids:
1 on the GPU; below it, 1 - reload seconds / prefill seconds per token (the reload is
bytes over the tier's link, kubellm.kv_tiers cites the figures), so a host-memory hit
on an 8B model on an H100 (2.6 us to reload a token over PCIe against 32 us to compute
it) is worth 0.92 of a GPU hit, a disk hit 0.23 (llm-d's default CPU weight is 0.8;
Dynamo weighs host 0.75, disk 0.25). The precise scorer and the latency model's cached
tokens both take a prefix's value from it, so neither needs a hand-set weight;
`TierValue.fixed` gives peers' weights as an override.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kubellm import kv_tiers

BITS = {kv_tiers.CPU: 1, kv_tiers.STORAGE: 2}
LOWER = tuple(BITS)


@dataclass
class LowerTiers:
    """Per replica slot: block hash -> bitmask of the lower tiers holding it."""

    per_replica: int = 1 << 22
    _held: dict[int, dict[int, int]] = field(default_factory=dict)
    dropped_total: int = 0

    def apply(self, slot: int, kind: str, medium: str, hashes: Iterable[int]) -> int:
        """One BlockStored / BlockRemoved of a lower tier; returns entries changed."""
        bit = BITS[medium]
        held = self._held.setdefault(slot, {})
        changed = 0
        for h in hashes:
            mask = held.get(h, 0)
            if kind == "BlockStored":
                if mask & bit:
                    continue
                if not mask and len(held) >= self.per_replica:
                    self.dropped_total += 1
                    continue
                held[h] = mask | bit
            else:
                if not mask & bit:
                    continue
                if mask & ~bit:
                    held[h] = mask & ~bit
                else:
                    del held[h]
            changed += 1
        return changed

    def tiers(self, slot: int, h: int) -> int:
        return self._held.get(slot, {}).get(h, 0)

    def entries(self, slot: int) -> int:
        return len(self._held.get(slot, ()))

    def clear(self, slot: int) -> None:
        self._held.pop(slot, None)


def matched_by_tier(on_gpu: Sequence[bool], lower: Sequence[int]) -> tuple[int, int, int]:
    """(GPU, host, disk) blocks of a chain's longest usable prefix, as vLLM finds it: the
    GPU's own run first, then the offload tiers continue it block by block (a block in
    host memory counts there even when it is on disk too) until the first miss."""
    gpu = 0
    while gpu < len(on_gpu) and on_gpu[gpu]:
        gpu += 1
    host = disk = 0
    for mask in lower[gpu:]:
        if mask & BITS[kv_tiers.CPU]:
            host += 1
        elif mask & BITS[kv_tiers.STORAGE]:
            disk += 1
        else:
            break
    return gpu, host, disk


@dataclass(frozen=True)
class TierValue:
    """A block's worth by tier, as a share of the prefill a GPU hit saves."""

    weights: Mapping[str, float]

    @classmethod
    def from_physics(
        cls,
        prefill_token_s: float,
        kv_bytes_per_token: int,
        host_gbps: float = kv_tiers.RELOAD_GBPS[kv_tiers.CPU],
        disk_gbps: float = kv_tiers.RELOAD_GBPS[kv_tiers.STORAGE],
    ) -> TierValue:
        """1 - reload / prefill per token (a disk block crosses both links), at least 0."""
        if prefill_token_s <= 0 or kv_bytes_per_token < 1:
            raise ValueError("tier values need a positive prefill cost and KV bytes per token")
        host = kv_bytes_per_token / (host_gbps * 1e9)
        disk = host + kv_bytes_per_token / (disk_gbps * 1e9)
        return cls({
            kv_tiers.GPU: 1.0,
            kv_tiers.CPU: max(0.0, 1.0 - host / prefill_token_s),
            kv_tiers.STORAGE: max(0.0, 1.0 - disk / prefill_token_s),
        })  # fmt: skip

    @classmethod
    def fixed(cls, weights: Mapping[str, float] = kv_tiers.PEER_WEIGHTS) -> TierValue:
        """Peers' hand-set weights (default llm-d's GPU 1.0, CPU 0.8; disk 0.25 as Dynamo)."""
        for tier, weight in weights.items():
            if tier not in kv_tiers.TIERS or not 0.0 <= weight <= 1.0:
                raise ValueError(f"tier weight {tier}={weight!r}: tiers are GPU, CPU, STORAGE "
                                 "and weights lie in [0, 1]")  # fmt: skip
        return cls({**dict.fromkeys(kv_tiers.TIERS, 0.0), **weights})

    def blocks(self, gpu: int, host: int, disk: int) -> float:
        """The matched prefix's worth in GPU-hit blocks."""
        w = self.weights
        return gpu * w[kv_tiers.GPU] + host * w[kv_tiers.CPU] + disk * w[kv_tiers.STORAGE]


# Llama 3.1 8B on one H100 (latency.Prior's prefill cost, 128 KiB of KV per token): CPU
# 0.92, disk 0.23. A model's own figures only move these a little: the ratio is KV bytes
# per token over FLOPs per token, about the same across dense models of one family.
DEFAULT_VALUE = TierValue.from_physics(32e-6, 131_072)


def cached_tokens(value: TierValue, gpu: int, host: int, disk: int, block_size: int) -> int:
    """The prompt tokens a latency.Dispatch counts as cached for a prefix matched by tier:
    a host or disk block counts at its worth, so the latency model's prefill of the rest
    carries each reload's cost (reload = (1 - worth) x the prefill it replaces)."""
    return round(value.blocks(gpu, host, disk) * block_size)
