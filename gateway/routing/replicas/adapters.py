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
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from kubellm.gateway.discovery.base import ModelTarget
from kubellm.gateway.routing.replicas.load import read_answer
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.scorers.bounded_load import within_bound
from kubellm.gateway.routing.scorers.consistent_hash import rendezvous_weight
from prometheus_client import CollectorRegistry, Counter, Histogram

from kubellm import metrics
from kubellm.contracts import registered_adapters
from kubellm.metrics import LoraInfo, parse_lora_info

log = logging.getLogger(__name__)

# loader(url, adapter name, adapter path): raises on failure (the engine refused, timed out)
Loader = Callable[[str, str, str], Awaitable[None]]


@dataclass
class _Replica:
    registered: set[str] = field(default_factory=set)
    scraped_at: float = 0.0
    info: LoraInfo | None = None
    info_at: float = 0.0
    sent: OrderedDict[str, None] = field(default_factory=OrderedDict)  # LRU of our sends


def lora_replicas(targets: Iterable[ModelTarget]) -> dict[str, tuple[str, frozenset[str]]]:
    """Replicas of models with adapters: url -> (served name, the adapters wanted)."""
    return {
        e.url: (t.served_name, frozenset(a.name for a in t.adapters))
        for t in targets
        if t.adapters
        for e in t.endpoints
    }


class AdapterView:
    """What this gateway knows of each replica's adapters (registered, active)."""

    def __init__(
        self, stale_after: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stale_after = stale_after
        self.clock = clock
        self._replicas: dict[str, _Replica] = {}
        self._demand: dict[str, float] = {}  # requests per adapter, decaying (popularity)
        self._requests = 0
        self._plans: dict[tuple[tuple[str, ...], int, float], tuple[int, Placement]] = {}

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

    def record_scrape(self, url: str, text: str) -> None:
        """A replica's scraped /metrics: its `vllm:lora_requests_info` (a load-view hook)."""
        self.record_info(url, parse_lora_info(text))

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
        self._requests += 1

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

    def plan(self, urls: tuple[str, ...], slots: int, load_bound: float) -> Placement:
        """`plan_placement` at the current demand, recomputed every PLAN_EVERY requests (or
        when the replicas change): the plan follows popularity, not each request."""
        key = (urls, slots, load_bound)
        cached = self._plans.get(key)
        if cached is None or self._requests - cached[0] >= PLAN_EVERY:
            cached = (self._requests, plan_placement(self._demand, urls, slots, load_bound))
            if len(self._plans) >= 64:  # replica sets come and go: keep a bounded few
                self._plans.clear()
            self._plans[key] = cached
        return cached[1]

    def slots(self, url: str, default: int) -> int:
        replica = self._replicas.get(url)
        if replica is not None and replica.info is not None and replica.info.max_lora > 0:
            return replica.info.max_lora
        return default


# Popularity: each request multiplies every adapter's count by this (half-life ~140).
DEMAND_DECAY = 0.995
# The placement plan is recomputed after this many requests.
PLAN_EVERY = 16


@dataclass(frozen=True)
class Placement:
    """Where each adapter should live: `homes[name]` the replicas whose slots keep it, and
    `swap` the replicas with a slot left for the adapters that fit in no slot of their own
    (the tail: each of their requests may load one there)."""

    homes: Mapping[str, tuple[str, ...]]
    swap: tuple[str, ...]

    def home(self, name: str) -> tuple[str, ...]:
        return self.homes.get(name, self.swap)


def plan_placement(
    demand: Mapping[str, float], replicas: Sequence[str], slots: int, load_bound: float
) -> Placement:
    """The placement that minimises slot loads at this demand, within the load bound.

    With n adapters asked for and S = replicas x slots slots: when n <= S every adapter gets
    a slot and the spare slots go to the hottest; otherwise the S - 1 hottest get a slot each
    and one slot swaps the rest (under independent requests, keeping the hottest resident
    and one slot for the others is the policy with the fewest misses: Aho, Denning and
    Ullman's A0). Then, while some replica would take more than `load_bound` x its share of
    the requests, the slot with the most requests is split: the hottest adapter gets a
    second slot (or the tail a second swap slot), taken from the coldest adapter that has
    one, which joins the tail. Slots go to replicas largest first, each to the least loaded
    replica with a slot free (replicas in sorted order, so gateways that agree on demand
    agree on the placement). Pure; `bench/gateway/lora_routing.py` compares it with the best
    placement found by search."""
    urls = sorted(set(replicas))
    wanted = sorted((n for n, d in demand.items() if d > 0), key=lambda n: (-demand[n], n))
    total_slots = len(urls) * max(1, slots)
    if not urls or not wanted:
        return Placement({}, ())
    copies = dict.fromkeys(wanted, 1)
    swaps = 0
    if len(wanted) > total_slots:
        for name in wanted[total_slots - 1 :]:
            del copies[name]
        swaps = 1
    else:  # spare slots: a second (third...) copy of the hottest, round robin
        for i in range(total_slots - len(wanted)):
            copies[wanted[i % len(wanted)]] += 1
    total = sum(demand[n] for n in wanted)
    cap = load_bound * total / len(urls)
    for _ in range(total_slots):
        _, loads = _assign(copies, swaps, demand, wanted, urls, max(1, slots))
        if swaps == 0 or max(loads.values()) <= cap * (1 + 1e-9):
            break
        top = min(copies, key=lambda n: (-demand[n] / copies[n], n))
        if copies[top] >= len(urls):  # on every replica already: nothing left to split
            break
        singles = sorted((n for n in copies if copies[n] == 1 and n != top), key=demand.get)
        if not singles:
            break
        del copies[singles[0]]  # the coldest joins the tail; its slot splits the busiest
        tail_load = sum(demand[n] for n in wanted if n not in copies) / swaps
        if tail_load > demand[top] / copies[top]:
            swaps += 1
        else:
            copies[top] += 1
    assignment, _ = _assign(copies, swaps, demand, wanted, urls, max(1, slots))
    homes = {n: tuple(sorted(u for u, held in assignment.items() if n in held)) for n in copies}
    swap = tuple(sorted(u for u, held in assignment.items() if SWAP in held))
    return Placement(homes, swap)


SWAP = ""  # the name of a swap slot in `_assign` (no adapter has an empty name)


def _assign(
    copies: Mapping[str, int],
    swaps: int,
    demand: Mapping[str, float],
    wanted: Sequence[str],
    urls: Sequence[str],
    slots: int,
) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Slots to replicas, largest first, each to the least loaded replica with room (and
    without that adapter already): replica -> the adapters it keeps, replica -> requests."""
    tail = sum(demand[n] for n in wanted if n not in copies)
    items = [(demand[n] / c, n) for n, c in copies.items() for _ in range(c)]
    items += [(tail / swaps, SWAP)] * swaps if swaps else []
    items.sort(key=lambda item: (-item[0], item[1]))
    held: dict[str, list[str]] = {u: [] for u in urls}
    loads = dict.fromkeys(urls, 0.0)
    for load, name in items:
        room = [u for u in urls if len(held[u]) < slots and name not in held[u]]
        room = room or [u for u in urls if len(held[u]) < slots]
        if not room:
            break
        chosen = min(room, key=lambda u: (loads[u], urls.index(u)))
        held[chosen].append(name)
        loads[chosen] += load
    return held, loads


class AdapterScorer:
    """Where a request for an adapter should go, in tiers 0.25 apart:

    - 1: a replica the placement plan (`plan_placement`, from the demand this gateway sees)
      gives the adapter, where it is resident (active, or sent there last by this gateway);
    - 0.75: elsewhere where it is resident (no load now);
    - 0.5: a replica the plan gives it where it is not resident yet (a load there is
      planned: it evicts a colder adapter, or the tail's last one from a swap slot);
    - elsewhere, where it must be loaded: 0.45 where a slot is free, else 0.45 x (1 - the
      popularity of the adapter it would evict, the least recently used one with no
      request on it), so a rarely used adapter is swapped out before a popular one, and a
      hot adapter is not evicted for a one-off;
    - 0 where every slot is busy with other adapters (the request would wait there).

    Without a plan (`for_replicas` not called) no replica is a home: resident 0.75, then
    the loads below 0.5."""

    name = "lora-affinity"

    def __init__(
        self, view: AdapterView, default_slots: int, placement: Placement | None = None
    ) -> None:
        self.view = view
        self.default_slots = default_slots
        self.placement = placement

    def for_replicas(self, urls: Sequence[str], load_bound: float) -> AdapterScorer:
        """This scorer with the placement plan for a model's replicas `urls` (all of them,
        before any filter) at the demand seen so far."""
        slots = min((self.view.slots(u, self.default_slots) for u in urls), default=1)
        plan = self.view.plan(tuple(sorted(urls)), slots, load_bound)
        return AdapterScorer(self.view, self.default_slots, plan)

    def resident(self, name: str, url: str) -> bool:
        """`name` is in a slot of `url` now, as far as this gateway knows (active there, or
        among the last adapters it sent there)."""
        return name in self.view.active(url) or name in self.view.recent(url)

    def bound_filter(self, name: str) -> Callable[[Sequence[Candidate], float], list[Candidate]]:
        """The bounded-load filter for a request naming adapter `name`: the replicas within
        the load bound, and those where `name` is resident whatever their load (the
        admission's saturation thresholds still keep a full replica out). The placement
        plan already keeps each replica's expected share within the bound; the bound on each
        request would also act on the moment-to-moment swings of the arrivals and send a
        hot adapter's requests where it is not resident, evicting another adapter to load
        it there: a swap costs a disk read and a slot wait, and its step time is paid by
        every request on that replica. bench/gateway/lora_routing.py measured the bound's slack for
        resident replicas: 1.6x the bound 230-237 loads per 1,000, 2.4x 195, none 168, with
        TTFT p95 falling too (docs/operations.md)."""

        def keep(candidates: Sequence[Candidate], load_bound: float) -> list[Candidate]:
            within = {c.url for c in within_bound(candidates, load_bound)}
            return [c for c in candidates if c.url in within or self.resident(name, c.url)]

        return keep

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]:
        name = request.adapter
        if name is None:
            return [0.0] * len(candidates)
        homes = set(self.placement.home(name)) if self.placement is not None else set()
        out = []
        for c in candidates:
            active = self.view.active(c.url)
            recent = self.view.recent(c.url)
            slots = self.view.slots(c.url, self.default_slots)
            if name in active or name in recent:
                out.append(1.0 if c.url in homes else 0.75)
            elif len(active) >= slots:
                out.append(0.0)
            elif c.url in homes:
                out.append(0.5)
            elif len(set(recent) | active) < slots:
                out.append(0.45)
            else:
                victim = next((a for a in recent if a not in active), None)
                out.append(0.0 if victim is None else 0.45 * (1.0 - self.view.demand(victim)))
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
    """Loads in progress: one per (replica, adapter), at most `limit` at once per replica.

    The bound is per replica, not per process: a replica that hangs on its load API holds
    only its own slots (until `timeout`), so another model's (or another replica's) loads
    go on. Unloads share the replica's slots."""

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
        self.limit = limit
        self._limits: dict[str, asyncio.Semaphore] = {}  # per replica URL
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

    def _slots(self, url: str) -> asyncio.Semaphore:
        slots = self._limits.get(url)
        if slots is None:
            if len(self._limits) >= 4096:  # replicas come and go: drop the idle ones
                for gone in [u for u, sem in self._limits.items() if not sem.locked()]:
                    del self._limits[gone]
            slots = self._limits[url] = asyncio.Semaphore(self.limit)
        return slots

    async def _load(self, url: str, name: str, path: str, labels: tuple[str, ...]) -> bool:
        if self.loader is None:
            return False
        async with self._slots(url):
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
        async with self._slots(url):
            try:
                await asyncio.wait_for(self.unloader(url, name, ""), self.timeout)
            except Exception:  # retried on the next scrape that still lists it
                return
        self.view.unloaded(url, name)


# A replica that failed to load an adapter is not asked again for it for this long.
RETRY_FAILED_LOAD_S = 30.0


async def scrape_models(client: aiohttp.ClientSession, url: str, base: str) -> set[str] | None:
    """The adapters `url` has registered for `base` (its /v1/models), None when unknown."""
    try:
        body = await read_answer(client, f"{url}/v1/models")  # bounded in bytes and time
        return registered_adapters(json.loads(body), base)
    except (TimeoutError, aiohttp.ClientError, ValueError, RecursionError):
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
