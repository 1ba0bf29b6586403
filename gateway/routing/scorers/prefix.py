"""Prefix affinity: send a prompt where its prefix's KV blocks probably are.

The prompt (chat messages rendered canonically) is cut into fixed-size chunks
of characters and hashed as a chain: hash_i = H(hash_{i-1}, chunk_i), so one
hash names a whole prefix. Per endpoint, a bounded LRU index remembers the
chain hashes of prompts sent there. Score = longest matched chain / chain
length, in [0, 1].

Memory: an index entry is a 64-bit hash kept as a Python int in an
OrderedDict: 88 bytes for the entry (measured with tracemalloc) plus 32 for the
int, about 120 bytes. The default 65,536 entries per endpoint is about 7.5 MiB
and covers 16 M characters (~4 M tokens) of distinct prefix at 256-character
chunks, more than one GPU's KV pool holds (an 8B model on 80 GB: ~470 k tokens).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

from kubellm.gateway.routing.index import approx_tiers
from kubellm.gateway.routing.index.kv_tiers import DEFAULT_VALUE
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest

CHUNK_CHARS = 256
MAX_CHUNKS = 512


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                parts.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "".join(parts)
    if content is None:
        return ""
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as one string: chat messages in a canonical form, or the completion prompt.

    The rendering only has to be stable and prefix-preserving (a conversation
    that grows keeps its earlier rendering as a prefix), not the model's template.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        out = []
        for message in messages:
            if isinstance(message, dict):
                role = str(message.get("role", ""))
                out.append(f"<|{role}|>{_content_text(message.get('content'))}\n")
        return "".join(out)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        return json.dumps(first if isinstance(first, list) else prompt)
    return ""


def _h(previous: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(previous + data, digest_size=8).digest()


def chunk_hashes(
    text: str, chunk_chars: int = CHUNK_CHARS, max_chunks: int = MAX_CHUNKS
) -> tuple[int, ...]:
    """Hash chain over the full chunks of `text` (a partial tail is not cacheable anyway)."""
    data = text.encode()
    step = chunk_chars
    out: list[int] = []
    previous = b""
    for start in range(0, min(len(data) // step, max_chunks) * step, step):
        previous = _h(previous, data[start : start + step])
        out.append(int.from_bytes(previous, "big"))
    return tuple(out)


def affinity_key(text: str, hashes: tuple[int, ...]) -> int:
    """The key that names a prompt's home replica: its first chunk, or the whole short prompt.

    The first chunk is what prompts sharing a system prompt have in common.
    """
    if hashes:
        return hashes[0]
    return int.from_bytes(_h(b"short", text.encode()), "big")


class PrefixIndex:
    """Per endpoint, an LRU set of chain hashes sent there, bounded in entries, each with
    the time it was last sent (`matched_since`: what was sent there lately). For an
    endpoint with a host tier (`set_tiers`), two LRUs: the GPU's and, below it, what the
    host tier still holds (index/approx_tiers.py)."""

    def __init__(self, capacity: int = 65_536, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.clock = clock
        self._by_url: dict[str, OrderedDict[int, float]] = {}
        self._tiers: dict[str, approx_tiers.ChunkTiers] = {}
        self._host: dict[str, OrderedDict[int, float]] = {}  # evicted from the GPU, on host

    def set_tiers(self, url: str, tiers: approx_tiers.ChunkTiers | None) -> None:
        """The endpoint's tiers in chunks (None: no host tier, one LRU of `capacity`)."""
        if self._tiers.get(url) == tiers:
            return
        if tiers is None:
            self._tiers.pop(url, None)
            self._host.pop(url, None)
            return
        self._tiers[url] = tiers = approx_tiers.ChunkTiers(
            min(tiers.gpu, self.capacity), min(tiers.host, self.capacity)
        )
        approx_tiers.spill(
            self._by_url.setdefault(url, OrderedDict()), self._host.setdefault(url, OrderedDict()),
            tiers,
        )  # fmt: skip

    def record(self, url: str, hashes: Sequence[int]) -> None:
        index = self._by_url.get(url)
        if index is None:  # (not `setdefault`, which builds a dict on every call)
            index = self._by_url[url] = OrderedDict()
        now = self.clock()
        host = self._host.get(url)
        for h in hashes:
            index[h] = now
            index.move_to_end(h)
            if host:
                host.pop(h, None)  # reloaded into the GPU
        tiers = self._tiers.get(url)
        if tiers is not None and host is not None:
            approx_tiers.spill(index, host, tiers)
        while len(index) > self.capacity:
            index.popitem(last=False)

    def matched(self, url: str, hashes: Sequence[int]) -> int:
        """Length of the longest prefix of the chain present on `url` (in any tier)."""
        if url in self._tiers:
            return sum(self.matched_by_tier(url, hashes))
        index = self._by_url.get(url)
        if not index:
            return 0
        count = 0
        for h in hashes:
            if h not in index:
                break
            count += 1
        return count

    def matched_by_tier(self, url: str, hashes: Sequence[int]) -> tuple[int, int]:
        """(GPU, host tier) chunks of the chain's longest prefix held on `url`; without a
        host tier, everything held counts as the GPU's."""
        host = self._host.get(url)
        if url not in self._tiers or host is None:
            return self.matched(url, hashes), 0
        return approx_tiers.matched_by_tier(self._by_url.get(url, OrderedDict()), host, hashes)

    def matched_since(self, url: str, hashes: Sequence[int], since: float) -> int:
        """Length of the longest prefix of the chain sent to `url` at or after `since`."""
        index = self._by_url.get(url)
        if not index:
            return 0
        host = self._host.get(url) or {}
        count = 0
        for h in hashes:
            if index.get(h, host.get(h, -math.inf)) < since:
                break
            count += 1
        return count

    def forget(self, url: str) -> None:
        """The endpoint is gone or restarted: nothing of it is held (its tiers stay known)."""
        self._by_url.pop(url, None)
        if url in self._host:
            self._host[url] = OrderedDict()

    def size(self, url: str) -> int:
        return len(self._by_url.get(url, ())) + len(self._host.get(url, ()))


class PrefixScorer:
    """Score = the prompt's longest chain held on the endpoint / its length; with a host
    tier, a chunk held there (evicted from the GPU) counts `host_weight` (kv_tiers'
    DEFAULT_VALUE: 1 - reload / prefill per token)."""

    name = "prefix"

    def __init__(
        self, index: PrefixIndex, host_weight: float = DEFAULT_VALUE.weights["CPU"]
    ) -> None:
        self.index = index
        self.host_weight = host_weight

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        total = len(request.chunk_hashes)
        if not total:
            return [0.0] * len(candidates)
        out = []
        for c in candidates:
            gpu, host = self.index.matched_by_tier(c.url, request.chunk_hashes)
            out.append((gpu + self.host_weight * host) / total)
        return out


class Sharing:
    """Which prompt beginnings this gateway has seen, and how much of each model's recent
    traffic shares them.

    `observe` remembers a prompt's first chunk hash (a bounded LRU set, about
    120 bytes an entry) and samples, per model, whether it had been seen before.
    Fewer than `low_below` seen among a full `window` of samples means the traffic
    is essentially unshared: there a cold prompt gains nothing from a fixed home
    and may go to the least-loaded replica. Every gateway replica sees a like share
    of the same traffic, so they switch alike.
    """

    def __init__(self, window: int = 64, low_below: int = 4, capacity: int = 65_536) -> None:
        self.window = window
        self.low_below = low_below
        self.capacity = capacity
        self._firsts: OrderedDict[int, None] = OrderedDict()
        self._samples: dict[str, deque[bool]] = {}

    def seen(self, first: int) -> bool:
        return first in self._firsts

    def observe(self, model: str, first: int) -> bool:
        """Record a routed prompt's first chunk; returns whether it had been seen before."""
        before = first in self._firsts
        self._firsts[first] = None
        self._firsts.move_to_end(first)
        if len(self._firsts) > self.capacity:
            self._firsts.popitem(last=False)
        samples = self._samples.get(model)
        if samples is None:  # (not `setdefault`, which builds a deque on every call)
            samples = self._samples[model] = deque(maxlen=self.window)
        samples.append(before)
        return before

    def shares(self, model: str) -> bool:
        """The model's recent traffic shares prompt beginnings: one of its recent samples
        had been seen before (no samples yet, or none repeated: False). Unique prompts
        never repeat a beginning, so they never pass; shared traffic passes from its first
        repeat, which with N front ends comes after about 1/N of one's traffic."""
        samples = self._samples.get(model)
        return samples is not None and any(samples)

    def may_share(self, model: str) -> bool:
        """Nothing says the model's traffic is unshared: fewer than a full `window` of
        samples yet, or a repeat among them. A front end presumes a prompt's home holds
        it (`profiles._Prefix`) unless its traffic says otherwise: with N front ends each
        sees a prefix's requests 1/N as often, so waiting for its own first repeat
        (`shares`) left most of the run without the presumption (bench/gateway/routing.py
        --workloads shared --gateways 1,3, seed 11: one front end's first repeat came
        8.3 s in, another's 11.5 s, of a 24 s run; its cold prompts spilled off a busy
        home that held them, 9 extra copies of 30 prefixes, 56.2% hits against 63.5%)."""
        samples = self._samples.get(model)
        return samples is None or len(samples) < self.window or any(samples)

    def low(self, model: str) -> bool:
        samples = self._samples.get(model)
        return samples is not None and len(samples) == self.window and sum(samples) < self.low_below
