"""LoRA adapters in the routing core: where each adapter is, and loading it where it is used.

Two levels, as vLLM has them:

- **registered** on a replica (vLLM lists it in `/v1/models`, with the base model as
  parent): the replica can serve it. A request naming an adapter goes only to replicas
  that have it registered (another would answer 404). When none has it, the gateway asks
  the least-loaded candidate to load it (vLLM's `/v1/load_lora_adapter`), at most
  `max_concurrent_loads` loads at once per gateway process and one per (replica, adapter),
  and the request waits for that load within its TTFT budget (the scheduler's deadline),
  then goes to the fallback or is refused like any request without a replica.
- **active** on a replica (in one of its `max_loras` GPU slots): serving it there costs no
  swap. vLLM reports the adapters of its running and waiting requests in
  `vllm:lora_requests_info`; the gateway also remembers the last `max_loras` adapters
  it sent to each replica (an LRU, as the engine's slots are). `AdapterScorer` prefers
  replicas where the adapter is active, then replicas with a slot to spare, within the
  bounded-load filter like every scorer.

Pure state and decisions live here; the HTTP requests that load and unload an adapter are
in `engine_api` (`Loader`, wired by `Scheduler.start` to its client, so both front ends
load adapters). The scrape of `/v1/models` (which adapters each replica has registered) is
here, beside `load.scrape_loop`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.scorers.consistent_hash import rendezvous_weight
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics

log = logging.getLogger(__name__)

# loader(url, adapter name, adapter path): raises on failure (the engine refused, timed out)
Loader = Callable[[str, str, str], Awaitable[None]]


@dataclass(frozen=True)
class LoraInfo:
    """One replica's `vllm:lora_requests_info`: its slot count, running and waiting adapters."""

    max_lora: int
    running: frozenset[str]
    waiting: frozenset[str]


def parse_lora_info(text: str) -> LoraInfo | None:
    """The current series of `vllm:lora_requests_info` (the one with the latest time: older
    label sets stay exported), or None when the engine has LoRA off."""
    best: tuple[float, dict[str, str]] | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metrics.LORA_REQUESTS_INFO and (
                best is None or sample.value > best[0]
            ):
                best = (sample.value, sample.labels)
    if best is None:
        return None
    labels = best[1]

    def names(key: str) -> frozenset[str]:
        return frozenset(n for n in labels.get(key, "").split(",") if n)

    try:
        slots = int(labels.get("max_lora", "0"))
    except ValueError:
        slots = 0
    return LoraInfo(slots, names("running_lora_adapters"), names("waiting_lora_adapters"))


def registered_adapters(models: object, base: str | None = None) -> set[str] | None:
    """The adapters a replica's `/v1/models` answer lists (cards with a parent); None when
    the answer is not vLLM's shape."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        return None
    out = set()
    for card in models["data"]:
        if (
            isinstance(card, dict)
            and isinstance(card.get("id"), str)
            and card.get("parent")
            and (base is None or card["parent"] == base)
        ):
            out.add(card["id"])
    return out


@dataclass
class _Replica:
    registered: set[str] = field(default_factory=set)
    scraped_at: float = 0.0
    info: LoraInfo | None = None
    info_at: float = 0.0
    sent: OrderedDict[str, None] = field(default_factory=OrderedDict)  # LRU of our sends


class AdapterView:
    """What this gateway knows of each replica's adapters (registered, active)."""

    def __init__(
        self, stale_after: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stale_after = stale_after
        self.clock = clock
        self._replicas: dict[str, _Replica] = {}
        self._demand: dict[str, float] = {}  # requests per adapter, decaying (popularity)

    def _get(self, url: str) -> _Replica:
        replica = self._replicas.get(url)
        if replica is None:
            replica = self._replicas[url] = _Replica()
        return replica

    # ------------------------------------------------------------------ observations

    def record_registered(self, url: str, names: Iterable[str]) -> None:
        replica = self._get(url)
        replica.registered = set(names)
        replica.scraped_at = self.clock()

    def record_info(self, url: str, info: LoraInfo | None) -> None:
        replica = self._get(url)
        replica.info, replica.info_at = info, self.clock()

    def loaded(self, url: str, name: str) -> None:
        """A load this gateway asked for succeeded."""
        self._get(url).registered.add(name)

    def unloaded(self, url: str, name: str) -> None:
        replica = self._get(url)
        replica.registered.discard(name)
        replica.sent.pop(name, None)

    def sent(self, url: str, name: str, slots: int) -> None:
        """A request for adapter `name` goes to `url`: remember it in the replica's LRU of
        `slots` adapters (the engine's slots are an LRU of that size too)."""
        replica = self._get(url)
        replica.sent[name] = None
        replica.sent.move_to_end(name)
        while len(replica.sent) > max(1, slots):
            replica.sent.popitem(last=False)
        for other in self._demand:  # a half-life of ~140 requests
            self._demand[other] *= DEMAND_DECAY
        self._demand[name] = self._demand.get(name, 0.0) + 1.0

    def forget(self, keep: Iterable[str]) -> None:
        keep = set(keep)
        for url in [u for u in self._replicas if u not in keep]:
            del self._replicas[url]

    # ------------------------------------------------------------------ questions

    def has(self, url: str, name: str) -> bool:
        """`url` has `name` registered (from its /v1/models, or a load we made since)."""
        replica = self._replicas.get(url)
        return replica is not None and name in replica.registered

    def registered(self, url: str) -> set[str]:
        replica = self._replicas.get(url)
        return set() if replica is None else set(replica.registered)

    def active(self, url: str) -> set[str]:
        """Adapters with requests on `url` now (running or waiting), from a fresh scrape of
        its `vllm:lora_requests_info`."""
        replica = self._replicas.get(url)
        if replica is None or replica.info is None:
            return set()
        if self.clock() - replica.info_at > self.stale_after:
            return set()
        return set(replica.info.running | replica.info.waiting)

    def recent(self, url: str) -> list[str]:
        """The last adapters this gateway sent to `url` (as many as it has slots), least
        recently sent first: the engine's next victim is the first of them not active."""
        replica = self._replicas.get(url)
        return [] if replica is None else list(replica.sent)

    def demand(self, name: str) -> float:
        """How much `name` is asked for lately, relative to the most asked-for adapter."""
        top = max(self._demand.values(), default=0.0)
        return self._demand.get(name, 0.0) / top if top > 0 else 0.0

    def slots(self, url: str, default: int) -> int:
        replica = self._replicas.get(url)
        if replica is not None and replica.info is not None and replica.info.max_lora > 0:
            return replica.info.max_lora
        return default


# Popularity: each request multiplies every adapter's count by this (half-life ~140).
DEMAND_DECAY = 0.995


class AdapterScorer:
    """1 where the adapter is active (no swap), 0.75 where this gateway sent it last (it is
    probably still in a slot); elsewhere the adapter must be loaded: 0.5 where a slot is
    free, else 0.5 x (1 - the popularity of the adapter it would evict: the least recently
    used one with no request on it), so a rarely used adapter is swapped out before a
    popular one; 0 where every slot is busy with other adapters (the request waits)."""

    name = "lora-affinity"

    def __init__(self, view: AdapterView, default_slots: int) -> None:
        self.view = view
        self.default_slots = default_slots

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        name = request.adapter
        if name is None:
            return [0.0] * len(candidates)
        out = []
        for c in candidates:
            active = self.view.active(c.url)
            recent = self.view.recent(c.url)
            slots = self.view.slots(c.url, self.default_slots)
            if name in active:
                out.append(1.0)
            elif name in recent:
                out.append(0.75)
            elif len(active) >= slots:
                out.append(0.0)
            elif len(set(recent) | active) < slots:
                out.append(0.5)
            else:
                victim = next((a for a in recent if a not in active), None)
                out.append(0.0 if victim is None else 0.5 * (1.0 - self.view.demand(victim)))
        return out


def load_target(name: str, candidates: Sequence[Candidate]) -> Candidate | None:
    """Where to load an adapter no candidate has: the least loaded, ties broken by the
    adapter's rendezvous order (so gateways that agree on load agree on the replica)."""
    if not candidates:
        return None
    key = int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "big") ^ len(name)
    return min(candidates, key=lambda c: (c.load, -rendezvous_weight(key, c.url)))


@dataclass
class AdapterMetrics:
    requests: Counter
    loads: Counter
    load_seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry) -> AdapterMetrics:
        labels = ["model", "deployment", "namespace", "adapter"]
        return cls(
            requests=Counter(
                metrics.GATEWAY_ADAPTER_REQUESTS.removesuffix("_total"),
                "Requests naming a LoRA adapter, by placement (resident: a replica had it; "
                "loaded: loaded for it first; fallback; refused).",
                [*labels, "route"],
                registry=registry,
            ),
            loads=Counter(
                metrics.GATEWAY_ADAPTER_LOADS.removesuffix("_total"),
                "Adapter loads this gateway asked a replica for, by outcome (ok|error|timeout).",
                [*labels, "outcome"],
                registry=registry,
            ),
            load_seconds=Histogram(
                metrics.GATEWAY_ADAPTER_LOAD_SECONDS,
                "Time a replica took to load an adapter this gateway asked for.",
                labels,
                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                registry=registry,
            ),
        )


class AdapterLoads:
    """Loads in progress: one per (replica, adapter), at most `limit` at once."""

    def __init__(
        self,
        view: AdapterView,
        metrics: AdapterMetrics,
        limit: int = 2,
        timeout: float = 60.0,
    ) -> None:
        self.view = view
        self.metrics = metrics
        self.loader: Loader | None = None  # set by the front end that can send requests
        self.unloader: Loader | None = None
        self.timeout = timeout
        self._limit = asyncio.Semaphore(limit)
        self._running: dict[tuple[str, str], asyncio.Task[bool]] = {}
        self.expected_seconds = 1.0  # a load's duration, a moving average of those seen
        self._failed: dict[tuple[str, str], float] = {}  # (url, name) -> when a load failed

    def start(self, url: str, name: str, path: str, labels: tuple[str, ...]) -> asyncio.Task[bool]:
        """The load of `name` on `url` (started now, or the one already running)."""
        key = (url, name)
        task = self._running.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(url, name, path, labels))
            self._running[key] = task
            task.add_done_callback(lambda _t: self._running.pop(key, None))
        return task

    def failed(self, name: str, url: str | None = None) -> bool:
        """A load of `name` (on `url`, or anywhere) failed in the last RETRY_FAILED_LOAD_S."""
        now = time.monotonic()
        return any(
            now - when < RETRY_FAILED_LOAD_S
            for (u, n), when in self._failed.items()
            if n == name and (url is None or u == url)
        )

    def pending(self, name: str) -> list[str]:
        """Replicas where `name` is being loaded now."""
        return [url for (url, n) in self._running if n == name]

    async def _load(self, url: str, name: str, path: str, labels: tuple[str, ...]) -> bool:
        if self.loader is None:
            return False
        async with self._limit:
            start = time.monotonic()
            outcome = "ok"
            try:
                await asyncio.wait_for(self.loader(url, name, path), self.timeout)
            except TimeoutError:
                outcome = "timeout"
            except Exception as error:  # the engine refused or failed: counted, logged
                outcome = "error"
                log.warning("loading adapter %r on %s failed: %s", name, url, error)
            self.metrics.loads.labels(*labels, name, outcome).inc()
            if outcome != "ok":
                self._failed[(url, name)] = time.monotonic()
                return False
            self._failed.pop((url, name), None)
            took = time.monotonic() - start
            self.metrics.load_seconds.labels(*labels, name).observe(took)
            self.expected_seconds = 0.8 * self.expected_seconds + 0.2 * took
            self.view.loaded(url, name)
            return True

    async def unload(self, url: str, name: str) -> None:
        if self.unloader is None:
            return
        async with self._limit:
            try:
                await asyncio.wait_for(self.unloader(url, name, ""), self.timeout)
            except Exception:  # retried on the next scrape that still lists it
                return
        self.view.unloaded(url, name)


_SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
# A replica that failed to load an adapter is not asked again for it for this long.
RETRY_FAILED_LOAD_S = 30.0


async def scrape_models(client: aiohttp.ClientSession, url: str, base: str) -> set[str] | None:
    """The adapters `url` has registered for `base` (its /v1/models), None when unknown."""
    try:
        async with client.get(f"{url}/v1/models", timeout=_SCRAPE_TIMEOUT) as response:
            response.raise_for_status()
            return registered_adapters(await response.json(content_type=None), base)
    except (TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError):
        return None


async def scrape_loop(
    client: aiohttp.ClientSession,
    replicas: Callable[[], Mapping[str, tuple[str, frozenset[str]]]],
    view: AdapterView,
    loads: AdapterLoads,
    interval: float = 1.0,
) -> None:
    """Each `interval`, read which adapters each LoRA replica has registered, and unload the
    ones its deployment no longer lists. `replicas()`: url -> (base model, wanted names)."""
    while True:
        current = dict(replicas())
        view.forget(current)
        found = await asyncio.gather(
            *(scrape_models(client, url, base) for url, (base, _) in current.items())
        )
        for (url, (_, wanted)), names in zip(current.items(), found, strict=True):
            if names is None:
                continue
            view.record_registered(url, names)
            for name in names - wanted:
                await loads.unload(url, name)
        await asyncio.sleep(interval)
