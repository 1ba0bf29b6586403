"""The pure model of one vLLM replica: paged KV pool, prefix cache, scheduler.

No I/O and no clock: `Engine.step()` runs one engine step and returns how long
it took (simulated seconds, from the profile) and which requests got a token.
The server turns that into HTTP; tests drive it directly.

What it copies from vLLM (v1 engine), because the control plane depends on it:
- KV pool of `num_blocks` blocks of `block_size` tokens; usage = 1 - free/total,
  where free blocks include cached blocks no request holds.
- Prefix caching: each full block is hashed together with its parent's hash;
  a new request looks up its prompt's full blocks from the start until the
  first miss, capped at prompt length - 1 tokens. Blocks are published when
  allocated for the tokens a step will compute. Queries count the request's
  tokens and hits the tokens found, once per request (a preempted request's
  second lookup is not counted, as in vLLM). Freed blocks keep their hash and
  join the back of an LRU free queue (a request's blocks are freed tail first, so
  its last blocks are evicted first); freed blocks without a hash (a partial last
  block) go to the front, reused before any cached block; allocating a block
  evicts its old hash. Like vLLM, a recomputed block whose hash is already cached
  is cached too (one hash, several blocks), so the hash outlives either copy.
- Block hashes are vLLM's own (kubellm.kv_blocks: chained SHA-256 of each block's
  tokens, with `("lora", name, path)` on every block of an adapter request and
  `("cache_salt", salt)` on block 0), so the KV events below name blocks as a real
  engine's do.
- KV events (`kv_events=True`, spec.routing.prefixIndex precise): every step's
  BlockStored (the blocks a request caches, in chain order) and BlockRemoved (a hash
  leaving the cache) and AllBlocksCleared (`reset_prefix_cache`) are kept for the
  runtime to publish as one batch (`take_events`), as vLLM's scheduler does after each
  step. One difference, on purpose: vLLM announces a BlockRemoved when any block
  holding a hash is evicted, even while a recomputed copy still holds it; the simulator
  announces it when the last copy goes, so a subscriber's index equals its cache.
- Continuous batching: each step gives a token budget to running requests
  first (one token per decoding request, a chunk for a prefilling one), then
  admits waiting requests in arrival order while budget, `max_num_seqs` and
  KV blocks allow; a prompt longer than the remaining budget is chunked.
- Preemption: when a running request needs a block and none is free, the most
  recently admitted running request is preempted (its blocks freed, requeued
  at the front, recomputed later).
- LoRA (profile.max_loras > 0): the running batch holds at most `max_loras`
  distinct adapters; a waiting request whose adapter would be one too many is
  skipped (it keeps its place) and later ones may go first, as vLLM's v1
  scheduler does. The adapters' GPU slots are an LRU of `max_loras`: a step
  that runs an adapter not in a slot loads it (evicting the least recently used
  idle one), which adds `lora_load_s` to the step (vLLM activates adapters
  synchronously before the forward pass; its `max_cpu_loras` defaults to
  `max_loras`, so an evicted adapter is read from disk again) and counts in
  `lora_loads`.
- A decode role's remote KV (P/D, vLLM's NixlConnector): a request that arrives with a
  prefill role's `kv_transfer_params` (`remote_kv`) takes its prompt's KV from the
  connector at admission: blocks for the whole prompt, every token but the last counted
  computed (vLLM recomputes the last one to make the first token), the tokens beyond the
  local prefix hit counted as external hits. The transfer's time is the runtime's (it
  waits before adding the request; sim_runtime). After a preemption it is recomputed.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kubellm.engine.sim_profiles import Profile
from kubellm.engine.sim_tiers import OffloadTiers

from kubellm import kv_blocks
from kubellm.kv_blocks import BlockHasher

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """KV blocks, an LRU queue of free blocks, and the hash -> cached block map.

    With `events` a list, each hash that leaves the cache is appended to it as a
    BlockRemoved event (its 64-bit external form)."""

    def __init__(self, num_blocks: int, events: list[dict[str, Any]] | None = None) -> None:
        self.events = events
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(num_blocks)
        )
        self.cached: dict[bytes, int] = {}  # block hash -> the block a lookup finds
        self.copies: dict[bytes, list[int]] = {}  # block hash -> more blocks holding it

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks) if self.blocks else 0.0

    def touch(self, block_id: int) -> None:
        """Take a reference on a cached block (taking it off the free queue if idle)."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free[block_id]
        block.ref_cnt += 1

    def allocate(self) -> int:
        """The least recently freed block, its old hash evicted from the cache."""
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._evict(block.block_hash, block_id)
        block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def _evict(self, block_hash: bytes, block_id: int) -> None:
        copies = self.copies.get(block_hash)
        if self.cached.get(block_hash) == block_id:
            if copies:  # the next copy, in caching order, answers lookups now
                self.cached[block_hash] = copies.pop(0)
            else:
                del self.cached[block_hash]
                if self.events is not None:
                    self.events.append(kv_blocks.block_removed([kv_blocks.external(block_hash)]))
        elif copies and block_id in copies:
            copies.remove(block_id)
        if copies is not None and not copies:
            del self.copies[block_hash]

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, tail first, so tails are evicted first.

        As vLLM: a freed block with a hash joins the back of the queue (LRU); one
        without (it can never be hit) goes to the front, to be reused first."""
        unhashed = []
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    unhashed.append(block_id)
                else:
                    self.free[block_id] = None
        for block_id in reversed(unhashed):  # at the front, in the order freed
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)

    def reset(self) -> bool:
        """Forget every cached hash (vLLM's reset_prefix_cache); False while a block is in
        use, as vLLM refuses then."""
        if any(block.ref_cnt for block in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self.copies.clear()
        if self.events is not None:
            self.events.append(kv_blocks.all_blocks_cleared())
        return True

    def cache(self, block_id: int, block_hash: bytes) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        if block_hash in self.cached:  # a recomputed copy: cached too, found second
            self.copies.setdefault(block_hash, []).append(block_id)
        else:
            self.cached[block_hash] = block_id


class CountingPool:
    """`BlockPool` without prefix caching, kept as a count (what `BatchEngine` uses in bulk).

    With prefix caching off no block carries a hash and none is shared, so which block a
    request holds is unobservable: the count of free ones is the pool. Every id is 0."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = range(num_blocks)  # its length: the pool's size
        self.cached: dict[bytes, int] = {}
        self.num_free = num_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free / len(self.blocks) if self.blocks else 0.0

    def allocate(self) -> int:
        if self.num_free <= 0:
            raise KeyError("no free KV block")
        self.num_free -= 1
        return 0

    def allocate_many(self, count: int) -> list[int]:
        if count > self.num_free:
            raise KeyError("not enough free KV blocks")
        self.num_free -= count
        return [0] * count

    def release(self, block_ids: Sequence[int]) -> None:
        self.num_free += len(block_ids)

    def reset(self) -> bool:
        return self.num_free == len(self.blocks)


def block_hashes(
    tokens: Sequence[int], block_size: int, start: int = 0, parent: bytes | None = None
) -> list[bytes]:
    """vLLM's chained hashes of the full blocks of `tokens` from block index `start` (no
    extra keys: a base-model request without cache salt)."""
    return _hasher(block_size).raw(tokens, start=start, parent=parent, max_blocks=1 << 30)


_HASHERS: dict[int, BlockHasher] = {}


def _hasher(block_size: int) -> BlockHasher:
    hasher = _HASHERS.get(block_size)
    if hasher is None:
        hasher = _HASHERS[block_size] = BlockHasher(block_size)
    return hasher


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the pool
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of computed full blocks
    status: str = WAITING
    preemptions: int = 0
    cached_tokens: int = 0  # prefix-cache hit at first admission
    local_cached: int = 0  # of which from this replica's own GPU cache (the rest external)
    finish_reason: str | None = None
    seed: int | None = None  # for next_token
    num_tokens: int = 0  # prompt + output, kept up to date (hot path)
    lora: str | None = None  # the adapter it runs with, or None for the base model
    lora_path: str = ""  # where the engine loaded the adapter from (in its block hashes)
    cache_salt: str | None = None  # in block 0's hash, as vLLM's cache_salt
    remote_kv: bool = False  # its prompt's KV comes from a prefill role (P/D)
    _lookup: tuple[int, list[bytes]] | None = None  # the prompt's hashes, by token count
    _since: int = -1  # BatchEngine: its fields are current as of this bulk step (-1: not bulk)

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt) + len(self.output)

    @property
    def extra_keys(self) -> tuple[Any, ...] | None:
        return kv_blocks.extra_keys((self.lora, self.lora_path) if self.lora else None)


@dataclass
class StepResult:
    """One engine step: its simulated duration and the tokens it produced."""

    duration: float
    tokens: list[tuple[Request, int]]  # (request, new token id), in order
    finished: list[Request]
    prefill_tokens: int = 0
    decode_tokens: int = 0

    @property
    def idle(self) -> bool:
        return not self.tokens and self.prefill_tokens == 0 and self.decode_tokens == 0


def next_token(request: Request, vocab_size: int) -> int:
    """A deterministic pseudo-random token from the request's content and position."""
    if request.seed is None:
        request.seed = hash((len(request.prompt), tuple(request.prompt[:8])))
    return hash((request.seed, request.num_tokens)) % vocab_size


class Engine:
    """One simulated replica. Add requests, call `step()` until they finish."""

    def __init__(self, profile: Profile, vocab_size: int = 50_000, kv_events: bool = False) -> None:
        self.profile = profile
        self.vocab_size = vocab_size
        self.hasher = _hasher(profile.block_size)
        self.kv_events: list[dict[str, Any]] | None = [] if kv_events else None
        self.pool = BlockPool(profile.num_blocks, self.kv_events)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.lora_slots: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.lora_loads = 0  # adapters loaded into a slot (each costs lora_load_s)
        self.tiers: OffloadTiers | None = None  # spec.engine.kvOffload (sim_tiers says how)
        if profile.prefix_caching and profile.host_tier_blocks and profile.kv_bytes_per_token:
            self.tiers = OffloadTiers(
                profile.kv_bytes_per_token * profile.block_size,
                profile.host_tier_blocks,
                profile.disk_tier_blocks,
                host_gbps=profile.host_gbps,
                disk_read_gbps=profile.disk_read_gbps,
                disk_write_gbps=profile.disk_write_gbps,
                events=self.kv_events,
            )
        self.external_queries = 0  # vLLM's external_prefix_cache_queries / _hits (tokens)
        self.external_hits = 0
        # a KV connector is asked for what the GPU lacks: the offload tiers, or a P/D role's
        self.kv_connector = self.tiers is not None
        self._reload_s = 0.0  # offloaded blocks loaded for this step's admissions

    # ------------------------------------------------------------------ requests

    def validate(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request cannot run at all (too long), or None."""
        limit = self.profile.max_model_len
        if prompt_tokens + max_tokens > limit:
            return (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion)."
            )
        if -(-(prompt_tokens + max_tokens) // self.profile.block_size) > len(self.pool.blocks):
            return "the request needs more KV blocks than the simulated pool has"
        return None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """Drop a request (client went away): free its blocks."""
        if request.status == RUNNING:
            self.running.remove(request)
        elif request.status == WAITING and request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ KV blocks

    def _blocks_needed(self, request: Request, new_tokens: int) -> int:
        total = request.computed + new_tokens
        return max(0, -(-total // self.profile.block_size) - len(request.blocks))

    def _lookup_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the prompt (capped at length - 1)."""
        if not self.profile.prefix_caching:
            return []
        lookup = request._lookup
        if lookup is None or lookup[0] != request.num_tokens:  # once per request, mostly
            tokens = request.prompt + request.output if request.output else request.prompt
            lookup = request._lookup = (request.num_tokens, self._hashes(
                request, tokens[: request.num_tokens - 1], 0, None
            ))  # fmt: skip
        hashes = lookup[1]
        hit: list[int] = []
        for block_hash in hashes:
            block_id = self.pool.cached.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def _lookup_offloaded(self, request: Request, gpu_hit: int) -> list[str]:
        """The tiers of the blocks that continue the GPU's hit below it (sim_tiers)."""
        if self.tiers is None or request._lookup is None:
            return []
        return self.tiers.lookup(request._lookup[1][gpu_hit:])

    def _load_offloaded(self, request: Request, tiers: list[str]) -> None:
        """Reload the offloaded blocks after the GPU's hit into the request's new blocks:
        they count as computed (at the reload's cost, not a prefill's) and are cached on
        the GPU (announced there as computed blocks are)."""
        assert self.tiers is not None and request._lookup is not None
        start = len(request.hashes)
        hashes = request._lookup[1][start : start + len(tiers)]
        self._reload_s += self.tiers.load(hashes, tiers)
        size = self.profile.block_size
        if request.preemptions == 0:
            self.external_hits += len(tiers) * size
            request.cached_tokens += len(tiers) * size
        self._cache_full_blocks(request, (start + len(tiers)) * size, store=False)
        request.computed = (start + len(tiers)) * size

    def _receive_remote(self, request: Request) -> None:
        """The prompt's KV beyond the local hit arrives from the prefill role: counted as
        external hits (NIXL's count: the prompt less the local hit) and cached here."""
        external = request.num_tokens - request.computed
        self.external_hits += external
        request.cached_tokens += external
        request.computed = request.num_tokens - 1
        self._cache_full_blocks(request, request.computed, store=False)

    def cached_prefix_tokens(self, prompt: list[int], cache_salt: str | None = None) -> int:
        """Tokens of `prompt` found in this replica's prefix cache now (a base-model request)."""
        return len(self._lookup_prefix(Request("", prompt, 1, cache_salt=cache_salt))) * (
            self.profile.block_size
        )

    def _admit(self, request: Request, hit: list[int]) -> None:
        """Take the hit blocks, allocate the rest for the first chunk, count the lookup."""
        size = self.profile.block_size
        if self.profile.prefix_caching and request.preemptions == 0:
            # As vLLM: recorded at admission, once per request (not after preemption).
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(hit) * size
            request.cached_tokens = request.local_cached = len(hit) * size
            if self.kv_connector:  # the connector is asked for what the GPU lacks
                self.external_queries += request.num_tokens - len(hit) * size
        for block_id in hit:
            self.pool.touch(block_id)
        request.blocks = list(hit)
        request.hashes = [self.pool.blocks[b].block_hash for b in hit]  # type: ignore[misc]
        request.computed = len(hit) * size
        request.status = RUNNING
        self.running.append(request)

    def _cache_full_blocks(self, request: Request, upto: int, store: bool = True) -> None:
        """Publish the full blocks of the first `upto` tokens (at allocation, as vLLM does:
        a request admitted later in the same step can already hit them)."""
        if not self.profile.prefix_caching:
            return
        size = self.profile.block_size
        full = min(upto, request.num_tokens) // size
        if full > len(request.hashes):  # build the token list only when a block filled up
            tokens = request.prompt + request.output
            parent = request.hashes[-1] if request.hashes else None
            start = len(request.hashes)
            new = self._hashes(request, tokens[: full * size], start, parent)
            for index, block_hash in enumerate(new, start=start):
                self.pool.cache(request.blocks[index], block_hash)
            request.hashes.extend(new)
            if self.kv_events is not None:
                self.kv_events.append(kv_blocks.block_stored(
                    [kv_blocks.external(h) for h in new],
                    kv_blocks.external(parent) if parent is not None else None,
                    tokens[start * size : full * size], size, request.lora,
                ))  # fmt: skip
            if store and self.tiers is not None:  # write-through to the host tier
                self.tiers.store(new, parent, tokens[start * size : full * size], size,
                                 request.lora)  # fmt: skip

    def block_hashes(self, request: Request, tokens: Sequence[int]) -> list[bytes]:
        """The hashes this engine keys the full blocks of `tokens` by, for `request` (its
        extra keys, its salt): what its cache holds, and what its KV events name
        (`kv_blocks.external` of each)."""
        return self._hashes(request, tokens, 0, None)

    def _hashes(
        self, request: Request, tokens: Sequence[int], start: int, parent: bytes | None
    ) -> list[bytes]:
        return self.hasher.raw(
            tokens, request.extra_keys, request.cache_salt, 1 << 30, start=start, parent=parent
        )

    def take_events(self) -> list[dict[str, Any]]:
        """The KV events since the last call (empty when events are off)."""
        if not self.kv_events:
            return []
        events = list(self.kv_events)
        self.kv_events.clear()
        return events

    def reset_prefix_cache(self) -> bool:
        """vLLM's /reset_prefix_cache: drop every cached block (refused while any is in use)."""
        return self.pool.reset()

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.release(request.blocks)
        request.blocks, request.hashes, request.computed = [], [], 0
        request.status = WAITING
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: str) -> None:
        self.pool.release(request.blocks)
        request.blocks, request.hashes = [], []
        request.status = FINISHED
        request.finish_reason = reason

    # ------------------------------------------------------------------ scheduling

    def step(self) -> StepResult:
        """Schedule one batch, 'run' it, emit tokens; returns the step's duration."""
        budget = self.profile.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        # 1. running requests first, in admission order; preempt from the back.
        index = 0
        size = self.profile.block_size
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            want = min(request.num_tokens - request.computed, budget)
            if (  # a decode inside a block it holds, not filling it: nothing to allocate/publish
                want == 1
                and (request.computed + 1) % size
                and request.computed // size < len(request.blocks)
            ):
                scheduled.append((request, 1))
                budget -= 1
                index += 1
                continue
            needed = self._blocks_needed(request, want)
            while needed > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            if request.status != RUNNING:
                break
            for _ in range(needed):
                request.blocks.append(self.pool.allocate())
            self._cache_full_blocks(request, request.computed + want)
            scheduled.append((request, want))
            budget -= want
            index += 1
        # 2. then waiting requests, in order, while budget, seats and blocks last.
        skipped: list[Request] = []  # one LoRA too many for the batch: they keep their place
        loras = {r.lora for r in self.running if r.lora is not None}
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
            request = self.waiting[0]
            if (
                request.lora is not None
                and request.lora not in loras
                and len(loras) >= self.profile.max_loras
            ):
                skipped.append(self.waiting.popleft())
                continue
            hit = self._lookup_prefix(request)
            offloaded = self._lookup_offloaded(request, len(hit))
            found = (len(hit) + len(offloaded)) * self.profile.block_size
            if request.remote_kv and request.preemptions == 0:
                found = request.num_tokens - 1  # the transfer brings all but the last token
            want = request.num_tokens - found
            if want > budget and not self.profile.chunked_prefill:
                break
            want = min(want, budget)
            new_blocks = -(-(found + want) // self.profile.block_size) - len(hit)
            idle_hits = sum(1 for b in hit if self.pool.blocks[b].ref_cnt == 0)
            if new_blocks + idle_hits > self.pool.num_free:
                break
            self.waiting.popleft()
            self._admit(request, hit)
            for _ in range(new_blocks):
                request.blocks.append(self.pool.allocate())
            if request.remote_kv and request.preemptions == 0:
                self._receive_remote(request)
            elif offloaded:
                self._load_offloaded(request, offloaded)
            self._cache_full_blocks(request, request.computed + want)
            scheduled.append((request, want))
            budget -= want
            if request.lora is not None:
                loras.add(request.lora)
        self.waiting.extendleft(reversed(skipped))
        return self._execute(scheduled)

    def _activate_loras(self, scheduled: list[tuple[Request, int]]) -> int:
        """Put the batch's adapters in slots (LRU); returns how many had to be loaded."""
        wanted = {request.lora for request, _ in scheduled if request.lora is not None}
        loads = 0
        for name in sorted(wanted):
            if name in self.lora_slots:
                self.lora_slots.move_to_end(name)
                continue
            while len(self.lora_slots) >= self.profile.max_loras:
                idle = next((n for n in self.lora_slots if n not in wanted), None)
                if idle is None:  # cannot happen: the batch holds at most max_loras
                    break
                del self.lora_slots[idle]
            self.lora_slots[name] = None
            loads += 1
        self.lora_loads += loads
        return loads

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """(running, waiting) adapter names, each once, in first-seen order (vLLM's
        `vllm:lora_requests_info` labels, joined with commas)."""
        running = dict.fromkeys(r.lora for r in self.running if r.lora is not None)
        waiting = dict.fromkeys(r.lora for r in self.waiting if r.lora is not None)
        return list(running), list(waiting)

    def _execute(self, scheduled: list[tuple[Request, int]]) -> StepResult:
        prefill = decode = 0
        tokens: list[tuple[Request, int]] = []
        finished: list[Request] = []
        for request, count in scheduled:
            is_decode = count == 1 and request.output
            decode += 1 if is_decode else 0
            prefill += 0 if is_decode else count
            request.computed += count
            if request.computed < request.num_tokens:
                continue  # a chunk of a longer prompt; no token yet
            token = next_token(request, self.vocab_size)
            request.output.append(token)
            request.num_tokens += 1
            tokens.append((request, token))
            if len(request.output) >= request.max_tokens:
                self.running.remove(request)
                self._finish(request, "length")
                finished.append(request)
        duration = self.profile.step_seconds(prefill, decode) if scheduled else 0.0
        if self.tiers is not None:  # loads block the step; stores overlap it (sim_tiers)
            duration = max(duration + self._reload_s, self.tiers.take_store_seconds())
            self._reload_s = 0.0
        if scheduled and self.profile.max_loras:
            duration += self._activate_loras(scheduled) * self.profile.lora_load_s
        return StepResult(duration, tokens, finished, prefill, decode)

    # ------------------------------------------------------------------ metrics

    def kv_cache_usage(self) -> float:
        return self.pool.usage()


class BatchEngine(Engine):
    """`Engine` with its decode steps in bulk: the same model, for the fleet simulation.

    `Engine.step` does work for every running request every step; a long
    simulation spends nearly all its time advancing requests that only decode
    (one token a step, inside a KV block they hold). Here a decoding request
    is advanced by a step counter instead: its `computed`, `num_tokens` and
    `output` are brought up to date (the same token ids, from `next_token`'s
    seed and position) when it takes a KV block, when it finishes, or on
    `sync()`. A step costs work for the requests prefilling, finishing or
    taking a block, not for the batch. The schedule, the step durations, the
    tokens, the requests finished and their order, the waiting and running
    lists and the KV usage are `Engine`'s, step by step (tests/engine/
    test_sim_core.py runs both side by side); what differs: `StepResult.tokens`
    lists the tokens of the requests not decoding in bulk (every first token
    is there; `decode_tokens` counts all), a running request's fields are
    stale until `sync()`, and block ids differ (nothing reads them without
    prefix caching).

    In bulk only where no per-token state is observable and every decoding
    request fits in every step's token budget: prefix caching off, no KV
    events, no LoRA, maxNumSeqs <= maxNumBatchedTokens; otherwise it is
    `Engine`. It relies on `Engine`'s order: requests that decode precede in
    the running list those that prefill (a prompt finishes only when every
    request before it got its whole share of the step); where that ever fails
    it stops working in bulk. A step that may need more KV blocks than are
    free (a preemption is possible) brings every request up to date and is
    `Engine.step`.
    """

    def __init__(
        self,
        profile: Profile,
        vocab_size: int = 50_000,
        kv_events: bool = False,
        token_ids: bool = True,
    ) -> None:
        super().__init__(profile, vocab_size, kv_events)
        self.bulk = (
            not profile.prefix_caching
            and not kv_events
            and not profile.max_loras
            and profile.max_num_seqs <= profile.max_num_batched_tokens
        )
        if self.bulk:
            self.pool = CountingPool(profile.num_blocks)  # type: ignore[assignment]
        # False: tokens decoded in bulk are 0, not next_token's ids (for a caller that counts
        # them only, as the fleet simulation does; first tokens are always real)
        self.token_ids = token_ids
        self._steps = 0  # steps taken in bulk: a bulk request's fields lag by steps - _since
        self._prefilling: list[Request] = []  # running, not in bulk (after the bulk ones)
        self._grows: dict[int, list[Request]] = {}  # step -> bulk requests taking a block then
        self._ends: dict[int, list[Request]] = {}  # step -> bulk requests finishing then

    # ------------------------------------------------------------------ bulk bookkeeping

    def _end_step(self, request: Request) -> int:
        return request._since + request.max_tokens - len(request.output)

    def _enter(self, request: Request) -> None:
        """Decode `request` in bulk from now on (its fields are current)."""
        request._since = now = self._steps
        end = now + request.max_tokens - len(request.output)
        self._ends.setdefault(end, []).append(request)
        # the step whose decode writes past its last block: computed = blocks x size then
        grow = now + len(request.blocks) * self.profile.block_size - request.computed + 1
        if grow <= end:
            self._grows.setdefault(grow, []).append(request)

    def _catch_up(self, request: Request) -> None:
        lag = self._steps - request._since
        if lag > 0:
            seed, first, vocab = request.seed, request.num_tokens, self.vocab_size
            if self.token_ids:
                request.output.extend([hash((seed, n)) % vocab for n in range(first, first + lag)])
            else:
                request.output.extend([0] * lag)
            request.computed += lag
            request.num_tokens += lag
        request._since = self._steps

    def sync(self) -> None:
        """Bring every running request's fields up to date (they stay in bulk)."""
        for request in self.running:
            if request._since >= 0:
                self._catch_up(request)

    def _leave_bulk(self) -> None:
        """Every request up to date and out of bulk (before `Engine`'s own step)."""
        for request in self.running:
            if request._since >= 0:
                self._catch_up(request)
                request._since = -1
        self._grows.clear()
        self._ends.clear()
        self._prefilling = []

    def _reenter_bulk(self) -> None:
        """After `Engine`'s own step: the decoding requests back in bulk."""
        decoding = [r.output != [] and r.num_tokens - r.computed == 1 for r in self.running]
        count = sum(decoding)
        if any(decoding[count:]):  # not the order the bulk steps rely on: stay per request
            self.bulk = False
            return
        for request in self.running[:count]:
            self._enter(request)
        self._prefilling = self.running[count:]

    def _in_full(self) -> StepResult:
        self._leave_bulk()
        result = super().step()
        self._reenter_bulk()
        return result

    def abort(self, request: Request) -> None:
        if not self.bulk:
            super().abort(request)
            return
        self._leave_bulk()
        super().abort(request)
        self._reenter_bulk()

    # ------------------------------------------------------------------ scheduling

    def step(self) -> StepResult:
        if not self.bulk:
            return super().step()
        profile = self.profile
        pool: CountingPool = self.pool  # type: ignore[assignment]
        size = profile.block_size
        step = self._steps + 1
        decoding = len(self.running) - len(self._prefilling)
        budget = profile.max_num_batched_tokens - decoding
        growing = self._grows.get(step, ())
        # 1. the running requests: the bulk ones take a token each (they come first), then
        #    the prefilling ones in order while the budget lasts
        planned: list[tuple[Request, int, int]] = []
        blocks = len(growing)
        for request in self._prefilling:
            if budget <= 0:
                break
            want = min(request.num_tokens - request.computed, budget)
            needed = self._blocks_needed(request, want)
            planned.append((request, want, needed))
            blocks += needed
            budget -= want
        if blocks > pool.num_free:  # a preemption may come: Engine's own step decides it
            return self._in_full()
        self._grows.pop(step, None)
        for request in growing:
            request.blocks.append(pool.allocate())
            if step + size <= self._end_step(request):
                self._grows.setdefault(step + size, []).append(request)
        scheduled: list[tuple[Request, int]] = []
        for request, want, needed in planned:
            if needed:
                request.blocks.extend(pool.allocate_many(needed))
            scheduled.append((request, want))
        # 2. waiting requests, in order, while budget, seats and blocks last (no prefix
        #    cache, no LoRA: Engine's loop without the lookups)
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < profile.max_num_seqs:
            request = waiting[0]
            want = request.num_tokens
            if want > budget and not profile.chunked_prefill:
                break
            want = min(want, budget)
            new_blocks = -(-want // size)
            if new_blocks > pool.num_free:
                break
            waiting.popleft()
            self._admit(request, [])
            request.blocks = pool.allocate_many(new_blocks)
            scheduled.append((request, want))
            self._prefilling.append(request)
            budget -= want
        self._steps = step
        return self._execute_bulk(scheduled, decoding, step)

    def _execute_bulk(
        self, scheduled: list[tuple[Request, int]], decoding: int, step: int
    ) -> StepResult:
        prefill, decode = 0, decoding
        tokens: list[tuple[Request, int]] = []
        ending = self._ends.pop(step, None)
        for request in ending or ():  # bulk requests on their last token
            self._catch_up(request)
            request._since = -1
            self._finish(request, "length")
        entered = False
        for request, count in scheduled:
            is_decode = count == 1 and request.output
            decode += 1 if is_decode else 0
            prefill += 0 if is_decode else count
            request.computed += count
            if request.computed < request.num_tokens:
                continue  # a chunk of a longer prompt; no token yet
            token = next_token(request, self.vocab_size)
            request.output.append(token)
            request.num_tokens += 1
            tokens.append((request, token))
            if len(request.output) >= request.max_tokens:
                self._finish(request, "length")
                ending = ending or []
            else:
                self._enter(request)
                entered = True
        if entered or ending is not None:
            self._prefilling = [r for r in self._prefilling if r._since < 0 and r.status == RUNNING]
        finished: list[Request] = []
        if ending is not None:  # out of the running list, in its order (Engine's order)
            kept: list[Request] = []
            for request in self.running:
                (kept if request.status == RUNNING else finished).append(request)
            self.running = kept
        duration = self.profile.step_seconds(prefill, decode) if scheduled or decoding else 0.0
        return StepResult(duration, tokens, finished, prefill, decode)
