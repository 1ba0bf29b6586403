"""Precise prefix affinity: score a replica by the prompt blocks its KV cache really holds.

Score = the longest run of the prompt's vLLM block hashes (kv_hashes.BlockHasher) that
the replica's KV events say it holds (kv_index.KVIndex.matched) / the prompt's full
blocks, in [0, 1]. For a replica whose events are missing or stale (`fresh(url)` False:
never synced, replay probe unanswered, index overflowed), or when the prompt could not be
hashed (no tokenizer for the model, block size not learnt yet, a prompt the tokenizer
cannot render), the score is the approximate one (scorers/prefix.py: the chunk chain the
gateway sent there), and `on_fallback(url, reason)` counts it.

Events lag the routing decision: a request's blocks are announced only once the engine
has admitted it and run a step. So for a replica whose events are fresh, a prefix the
gateway sent there within the last `recent_s` seconds counts too (the approximate chain
sent there since, as a share of the prompt), and the score is the larger of the two: a
burst of one tenant's requests follows the first one instead of scattering before its
blocks are announced. A removal announced by the replica after the send ends that credit
(the send is older than what the events now say), so an eviction right after a send is
believed at once.

Offload tiers (spec.engine.kvOffload): a prefix the replica holds below its GPU (host
memory, disk: the events' medium) counts at its worth, `tier_value` (kv_tier_index:
1 - reload / prefill per token; peers' fixed weights as an override), so a host-tier
hit ranks just under a GPU hit and far over a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kubellm.gateway.routing.index.kv_events import KVIndex
from kubellm.gateway.routing.index.kv_tiers import DEFAULT_VALUE, TierValue
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.scorers.prefix import PrefixIndex

RECENT_S = 2.0  # seconds a prefix sent to a replica counts before its events announce it


class PrecisePrefixScorer:
    name = "prefix-precise"

    def __init__(
        self,
        kv: KVIndex,
        fresh: Callable[[str], bool],
        approximate: PrefixIndex,
        on_fallback: Callable[[str, str], None] | None = None,
        recent_s: float = RECENT_S,
        tier_value: TierValue = DEFAULT_VALUE,
    ) -> None:
        self.kv = kv
        self.fresh = fresh
        self.approximate = approximate
        self.on_fallback = on_fallback
        self.recent_s = recent_s
        self.tier_value = tier_value

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        blocks = request.kv_hashes
        chunks = request.chunk_hashes
        out = []
        since = self.approximate.clock() - self.recent_s
        for c in candidates:
            if blocks and self.fresh(c.url):
                matched = self.kv.matched_by_tier(c.url, blocks)
                held = self.tier_value.blocks(*matched) / len(blocks)
                if chunks and self.recent_s > 0:
                    after = max(since, self.kv.removed_at(c.url))
                    sent = self.approximate.matched_since(c.url, chunks, after) / len(chunks)
                    held = max(held, sent)
                out.append(held)
                continue
            if self.on_fallback is not None:
                self.on_fallback(c.url, "stale" if blocks else "unhashed")
            gpu, host = self.approximate.matched_by_tier(c.url, chunks)
            out.append(self.tier_value.blocks(gpu, host, 0) / len(chunks) if chunks else 0.0)
        return out
