"""KV-cache offload tiers: capacity in tokens, reload costs, and when host memory pays.

Pure arithmetic shared by status.capacity, `kubellm plan`, the simulator and the gateway's
latency model. A replica's KV lives in up to three tiers: the GPU pool (HBM), a host-memory
tier (spec.engine.kvOffload.hostGiB, vLLM's native OffloadingConnector) and a disk tier
(spec.engine.kvOffload.disk, vLLM's TieringOffloadingSpec `fs` tier). A block found in a
lower tier is copied back to the GPU instead of recomputed: its cost is its bytes over the
link's bandwidth (RELOAD_GBPS) instead of its share of a prefill.

Bandwidths (effective, one direction, per GPU):
- host: PCIe 5.0 x16 moves 32 GT/s x 16 lanes x 128/130 = 63 GB/s (PCI-SIG PCIe 5.0
  base specification); DMA copies of paged KV blocks reach about 80% of it, 50 GB/s
  (H100 SXM, PCIe Gen5 host link). PCIe 4.0 (A100): half, 25 GB/s.
- disk: one PCIe 4.0 NVMe SSD reads 7 GB/s sequentially (Samsung 990 PRO and Micron 7450
  datasheets: 7.45 / 6.8 GB/s) and writes about 5-6; the fs tier's reads go through the
  page cache with 16 threads, so 6 GB/s read and 5 GB/s write are used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30
DISK_DIR = "/kv-offload"  # where the pod mounts the disk tier's volume (operator and launcher)
GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"  # vLLM's KV-event medium strings
TIERS = (GPU, CPU, STORAGE)
# Effective bandwidth of a reload into the GPU and of a store out of it, GB/s (see above).
RELOAD_GBPS = {CPU: 50.0, STORAGE: 6.0}
STORE_GBPS = {CPU: 50.0, STORAGE: 5.0}
# Per-tier weights of a cached block, for parity with peers' scorers (llm-d's precise
# prefix scorer: GPU 1.0, CPU 0.8; Dynamo: host 0.75, disk 0.25). kubellm's default is the
# latency model's (reload cost vs prefill), not these; they are an override.
PEER_WEIGHTS = {GPU: 1.0, CPU: 0.8, STORAGE: 0.25}


@dataclass(frozen=True)
class TierCapacity:
    """One replica's KV capacity, in tokens, per tier (0: no such tier)."""

    gpu_tokens: int
    host_tokens: int = 0
    disk_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.gpu_tokens + self.host_tokens + self.disk_tokens

    def sessions(self, tokens_per_session: int) -> dict[str, int]:
        """Whole sessions of `tokens_per_session` tokens each tier holds."""
        if tokens_per_session < 1:
            raise ValueError("a session holds at least one token")
        return {
            GPU: self.gpu_tokens // tokens_per_session,
            CPU: self.host_tokens // tokens_per_session,
            STORAGE: self.disk_tokens // tokens_per_session,
        }


def tier_capacity(
    kv_bytes_per_token: int, gpu_pool_bytes: int, host_gib: float = 0.0, disk_gib: float = 0.0
) -> TierCapacity:
    """Tokens each tier of one replica holds (host and disk sizes as the spec gives them)."""
    if kv_bytes_per_token < 1:
        raise ValueError("KV bytes per token must be positive")
    return TierCapacity(
        gpu_tokens=gpu_pool_bytes // kv_bytes_per_token,
        host_tokens=int(host_gib * GIB) // kv_bytes_per_token,
        disk_tokens=int(disk_gib * GIB) // kv_bytes_per_token,
    )


def transfer_seconds(tokens: int, kv_bytes_per_token: int, gbps: float) -> float:
    """Seconds to move `tokens` tokens of KV over a link of `gbps` GB/s."""
    return tokens * kv_bytes_per_token / (gbps * 1e9)


@dataclass(frozen=True)
class HostOrReplicas:
    """How a fleet holds a working set larger than its GPU pools: the extra replicas that
    would hold it all in HBM, or the host memory per replica that would hold the rest."""

    working_set_tokens: int
    fleet_gpu_tokens: int
    extra_replicas: int
    host_gib_per_replica: float
    replica_hour_price: float
    host_hour_price: float  # the fleet's added host memory, per hour
    fits_host: bool  # the host GiB fit beside what a node can give (max_host_gib)

    @property
    def host_is_cheaper(self) -> bool:
        replicas = self.extra_replicas * self.replica_hour_price
        return self.fits_host and self.host_hour_price < replicas


def host_or_replicas(
    working_set_tokens: int,
    kv_bytes_per_token: int,
    gpu_tokens_per_replica: int,
    replicas: int,
    *,
    replica_hour_price: float,
    host_gib_hour_price: float,
    max_host_gib: float,
) -> HostOrReplicas:
    """Pure. The working set beyond the fleet's GPU pools, held by more replicas
    (ceil(working set / GPU tokens per replica) - replicas) or by a host tier on each of
    the replicas (the overflow's bytes / replicas). The host tier is cheaper while its
    memory costs less than the replicas and fits in `max_host_gib` per replica. It does
    not add concurrency: running requests still need the GPU pool (the autoscaler scales
    on it), so this is about the cache, not about throughput."""
    if replicas < 1 or gpu_tokens_per_replica < 1:
        raise ValueError("a fleet has at least one replica with a KV pool")
    fleet = gpu_tokens_per_replica * replicas
    over = max(0, working_set_tokens - fleet)
    extra = max(0, math.ceil(working_set_tokens / gpu_tokens_per_replica) - replicas)
    host_gib = over * kv_bytes_per_token / GIB / replicas
    return HostOrReplicas(
        working_set_tokens=working_set_tokens,
        fleet_gpu_tokens=fleet,
        extra_replicas=extra,
        host_gib_per_replica=host_gib,
        replica_hour_price=replica_hour_price,
        host_hour_price=host_gib * replicas * host_gib_hour_price,
        fits_host=host_gib <= max_host_gib,
    )
