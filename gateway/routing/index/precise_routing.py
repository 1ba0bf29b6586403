"""Precise prefix routing's state in one gateway process (spec.routing.prefixIndex precise).

- `KVIndex` + `KVEventsSubscriber` (kv_index.py): which blocks each ready replica of a
  precise model holds, from its KV events; `run` keeps the subscriptions equal to the
  ready replicas of the models that ask for precise mode (checked every `interval`).
- Per model, the prompt's block hashes (kv_hashes.py): the model's own tokenizer, given
  per served name (`tokenizers`: a local directory or a Hugging Face id the gateway may
  fetch), and the engine's block size, learnt from its events (BlockStored carries it),
  so no second setting can disagree with the engine.
- Metrics: `kubellm_gateway_prefix_index_fallbacks_total{model, reason}` (a candidate
  scored by the approximate index: `stale` events, or `unhashed`: no tokenizer, block size
  not learnt yet, or a prompt that cannot be tokenized) and
  `kubellm_gateway_kv_index_entries` (block entries in the index).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from kubellm.gateway.discovery.base import Endpoint, ModelTarget
from kubellm.gateway.routing.index.kv_events import (
    EventAddress,
    KVEventsSubscriber,
    KVIndex,
    event_address,
)
from kubellm.gateway.routing.index.kv_hashes import (
    BlockHasher,
    PromptTokenizer,
    SimPromptTokenizer,
    load_tokenizer,
)

from kubellm.sources import parse_source

log = logging.getLogger(__name__)

FALLBACKS = "kubellm_gateway_prefix_index_fallbacks_total"
ENTRIES = "kubellm_gateway_kv_index_entries"

AddressOf = Callable[[ModelTarget, Endpoint], EventAddress]

RETRY_S = 60.0  # seconds before a tokenizer that failed to load is tried again


def default_address(target: ModelTarget, endpoint: Endpoint) -> EventAddress:
    """The engine's event sockets: its host, its events port (the endpoint's own, else
    spec.routing.kvEventsPort) and the next port."""
    return event_address(endpoint.url, endpoint.kv_events_port or target.routing.kv_events_port)


class PreciseRouting:
    def __init__(
        self,
        tokenizers: Mapping[str, str] | None = None,
        *,
        index: KVIndex | None = None,
        subscriber: KVEventsSubscriber | None = None,
        address_of: AddressOf = default_address,
        registry: Any = None,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index or KVIndex()
        self.subscriber = subscriber or KVEventsSubscriber(self.index)
        self.tokenizer_paths = dict(tokenizers or {})
        self.address_of = address_of
        self.interval = interval
        self._tokenizers: dict[str, PromptTokenizer | SimPromptTokenizer | None] = {}
        self._loading: set[str] = set()  # models whose tokenizer a thread is loading
        self._failed: dict[str, float] = {}  # model -> when its tokenizer last failed to load
        self.clock = clock
        self._hashers: dict[tuple[int, str], BlockHasher] = {}
        self._fallbacks: Any = None
        self._entries: Any = None
        # The last few requests' hashes, by body identity (the body is held, so its id
        # cannot be reused while cached): a queued request is ordered again on every wake.
        self._cache: OrderedDict[int, tuple[Any, tuple[int, ...]]] = OrderedDict()
        if registry is not None:
            from prometheus_client import Counter, Gauge

            self._fallbacks = Counter(
                FALLBACKS.removesuffix("_total"),
                "Candidates scored by the approximate prefix index in precise mode, by reason "
                "(stale: the replica's KV events are missing or stale; unhashed: the prompt "
                "could not be hashed as the engine hashes it).",
                ["model", "reason"],
                registry=registry,
            )
            self._entries = Gauge(
                ENTRIES, "Block entries in the precise prefix index.", registry=registry
            )

    # ---------------------------------------------------------------- subscriptions
    def wanted(self, targets: Mapping[str, ModelTarget]) -> dict[str, EventAddress]:
        """The event address of every routable replica of every precise model."""
        out = {}
        for target in targets.values():
            if target.routing.prefix_index != "precise":
                continue
            for endpoint in target.routable:
                out[endpoint.url] = self.address_of(target, endpoint)
        return out

    async def run(self, snapshot: Callable[[], Mapping[str, ModelTarget]]) -> None:
        """Follow the events of the replicas `snapshot` names, and load the tokenizers of
        precise models (`load_in_background`), until cancelled."""
        try:
            while True:
                targets = snapshot()
                self.load_in_background(targets)
                self.subscriber.sync(self.wanted(targets))
                if self._entries is not None:
                    self._entries.set(self.index.entries())
                await asyncio.sleep(self.interval)
        finally:
            await self.subscriber.close()

    def fresh(self, url: str) -> bool:
        return self.subscriber.fresh(url)

    def fallback(self, model: str) -> Callable[[str, str], None]:
        def count(url: str, reason: str) -> None:
            if self._fallbacks is not None:
                self._fallbacks.labels(model, reason).inc()

        return count

    # ---------------------------------------------------------------- prompt hashes
    def unprepared(self, targets: Mapping[str, ModelTarget]) -> list[str]:
        """Precise models whose tokenizer has not been tried yet, or failed to load at least
        RETRY_S ago (a hub or volume that was briefly unreachable is tried again)."""
        now = self.clock()
        return [
            t.served_name
            for t in targets.values()
            if t.routing.prefix_index == "precise"
            and (
                t.served_name not in self._tokenizers
                or now - self._failed.get(t.served_name, math.inf) >= RETRY_S
            )
        ]

    def prepare(self, targets: Mapping[str, ModelTarget]) -> None:
        """Load the tokenizer of each precise model in `targets`, blocking (tests, benches)."""
        for model in self.unprepared(targets):
            self._load(targets[model])

    def load_in_background(self, targets: Mapping[str, ModelTarget]) -> None:
        """Start loading the tokenizer of each precise model not tried yet, one daemon thread
        each: loading takes seconds, and a download from a hub that stalls must hold up
        only that model's hashing (its prompts are scored approximately meanwhile), not
        the event following, the other models or the process's exit."""
        for model in self.unprepared(targets):
            if model not in self._loading:
                self._loading.add(model)
                thread = threading.Thread(
                    target=self._load, args=(targets[model],), name=f"tokenizer-{model}"
                )
                thread.daemon = True
                thread.start()

    def _load(self, target: ModelTarget) -> None:
        """The model's tokenizer: the one `tokenizers` names, else an hf:// model's own
        (`tokenizer_of`). A model without one, or whose tokenizer fails to load, is scored
        approximately (`unhashed`)."""
        model = target.served_name
        path, revision = self.tokenizer_paths.get(model), None
        if not path:
            path, revision = tokenizer_of(target.model_source)
        try:
            tokenizer = load_tokenizer(path, revision) if path else None
            self._failed.pop(model, None)
        except Exception as error:  # a bad path must not fail requests: degrade
            log.warning(
                "precise routing of %s: tokenizer %s: %s (retried in %.0f s)",
                model, path, error, RETRY_S,
            )  # fmt: skip
            tokenizer = None
            self._failed[model] = self.clock()
        self._tokenizers[model] = tokenizer
        self._loading.discard(model)

    def block_size(self, target: ModelTarget) -> int | None:
        for endpoint in target.routable:
            size = self.index.block_size(endpoint.url)
            if size:
                return size
        return None

    def kv_hashes(self, target: ModelTarget, body: Mapping[str, Any] | None) -> tuple[int, ...]:
        """The prompt's block hashes as the model's engines compute them; () when unknown."""
        if body is None:
            return ()
        size = self.block_size(target)
        tokenizer = self._tokenizers.get(target.served_name)  # loaded by `prepare`
        if size is None or tokenizer is None:
            return ()
        cached = self._cache.get(id(body))
        if cached is not None and cached[0] is body:
            return cached[1]
        try:
            token_ids = tokenizer.token_ids(dict(body))
        except Exception:  # a prompt the template cannot render: score approximately
            token_ids = None
        if not token_ids:
            return ()
        hasher = self._hashers.get((size, "sha256"))
        if hasher is None:
            hasher = self._hashers[size, "sha256"] = BlockHasher(size)
        salt = body.get("cache_salt")
        hashes = hasher.block_hashes(
            token_ids,
            lora=adapter_key(target, body.get("model")),
            cache_salt=salt if isinstance(salt, str) and salt else None,
        )
        self._cache[id(body)] = (body, hashes)
        while len(self._cache) > 32:
            self._cache.popitem(last=False)
        return hashes


def tokenizer_of(model_source: str) -> tuple[str | None, str | None]:
    """(Hugging Face id, revision) of an hf:// model source: the gateway loads the model's
    tokenizer from the same repository and revision as the engines load the model (the
    tokenizer files only, not the weights; HF_TOKEN and HF_ENDPOINT apply as for any
    transformers download). (None, None) for other sources: their files are on volumes
    the gateway does not mount, so `--tokenizer` must name them."""
    try:
        source = parse_source(model_source)
    except ValueError:
        return None, None
    if source.scheme != "hf":
        return None, None
    return source.location, source.revision


def adapter_key(target: ModelTarget, model: Any) -> tuple[str, str] | None:
    """(name, path) of the adapter a request names as its model, as the engine registered
    it (vLLM hashes every block of an adapter request with `("lora", name, path)`); None
    for the base model. The path is the one replicas load it from (spec.adapters through
    `kubellm.sources.adapter_path`: the launcher's --lora-modules and the gateway's
    runtime loads alike)."""
    if not isinstance(model, str) or model == target.served_name:
        return None
    for adapter in target.adapters:
        if adapter.name == model:
            return adapter.name, adapter.path
    return None


def tokenizer_pairs(values: list[str]) -> dict[str, str]:
    """`--tokenizer MODEL=PATH` values as {served name: tokenizer directory or HF id}."""
    pairs: dict[str, str] = {}
    for value in values:
        model, sep, path = value.partition("=")
        if not sep or not model or not path:
            raise ValueError(f"--tokenizer {value!r}: expected MODEL=PATH (a directory or HF id)")
        pairs[model] = path
    return pairs
