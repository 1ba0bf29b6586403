"""What each replica's KV cache really holds, from the engines' own KV-cache events.

`KVIndex` is the pure half: an exact map block hash -> the replicas holding it, fed by
vLLM's event batches (`apply`), with each replica's sequence number checked so a gap is
noticed (`Applied.gap`) and a restarted publisher (its sequence goes back) resets that
replica's entries. `KVEventsSubscriber` is the I/O half: one ZMQ SUB socket per replica,
a replay request (the publisher's ROUTER socket) after a gap and as a periodic probe, and
`fresh(url)` saying whether the replica's events can be trusted right now. A replica that
is not fresh is scored by the approximate index instead (scorers/precise.py).

Wire format (vllm/distributed/kv_events.py, vLLM 0.32): a PUB message is three frames,
(topic, 8-byte big-endian sequence number, msgpack payload); the payload is
`[ts, [event, ...], data_parallel_rank]`, each event a map with `type` "BlockStored"
(`block_hashes`, 64-bit ints, in chain order), "BlockRemoved" (`block_hashes`) or
"AllBlocksCleared". A replay request is (empty frame, 8-byte start sequence) to the
ROUTER socket; it answers (empty, topic, seq, payload) per buffered batch at or after the
start, then (empty, empty, seq -1, empty).

Memory: one entry is a dict slot from a 64-bit hash to a small int bitmask of replica
slots (replicas are numbered per index, at most `MAX_REPLICAS`), plus a slot in its
replica's own set (so clearing a replica costs its own entries, not the whole index);
measured with tracemalloc in tests/gateway/routing/index/test_kv_index.py and printed by
bench/gateway/front_end_memory.py. Every peer may be hostile, so the index takes only what vLLM
sends and bounds the rest:

- a block hash is a 64-bit int (vLLM's event form) or bytes of at most `MAX_HASH_BYTES`
  (the raw SHA-256 form, kept as its last 64 bits as vLLM converts it); anything else is a
  malformed entry, skipped and counted (`Applied.malformed`), never an error;
- the map holds at most `capacity` entries in all (default 4 M, ~560 MB at worst) and
  `per_replica` entries per replica (default 1 Mi: 16 M tokens of 16-token blocks, more
  than any GPU's KV pool); a store past either is dropped and counted, and the replica that
  lost it is no longer fresh (scored approximately) until its cache is cleared or it
  restarts; one replica filling its share leaves every other replica precise;
- `steps` applies a batch in slices of `SLICE` hashes, and the subscriber yields to the
  event loop between slices, so a batch of a million hashes never holds the loop; the
  subscriber's sockets refuse a message over `MAX_MESSAGE_BYTES` (4 MiB, ZMQ's maximum
  message size: the connection is dropped, and the follower starts again) and queue at
  most `RECEIVE_QUEUE` (8) messages (more are dropped by ZMQ: a gap, filled by replay).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubellm.gateway.routing.index.kv_tiers import LOWER, LowerTiers, matched_by_tier

from kubellm import kv_blocks

log = logging.getLogger(__name__)

MAX_REPLICAS = 1024
END_SEQ = kv_blocks.END_SEQ
MAX_HASH_BYTES = 64  # vLLM's raw block hash is a 32-byte SHA-256 digest
MAX_BLOCK_SIZE = 1 << 16  # tokens per block (vLLM's are 16 on GPUs, 128 on CPUs)
SLICE = 8192  # hashes applied between two yields to the event loop
# One ZMQ message (a batch): ~70 k blocks with their tokens, where a vLLM step's batch holds
# at most its batched tokens' blocks (8 k tokens: 512 blocks of 16, ~40 KiB).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Messages a SUB socket queues before ZMQ drops new ones (a gap, filled through replay):
# with MAX_MESSAGE_BYTES, at most 32 MiB waiting per replica.
RECEIVE_QUEUE = 8
MIN_INT64 = -(1 << 63)


def block_hash(value: Any) -> int | None:
    """A published block hash as the index keeps it (its 64-bit int form), None when it is
    not one of the forms vLLM sends."""
    if type(value) is int:
        return value & kv_blocks.MASK64 if MIN_INT64 <= value <= kv_blocks.MASK64 else None
    if isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BYTES:
        return kv_blocks.external(value)
    return None


@dataclass
class Applied:
    """What one batch did: `gap` is the first missing sequence number when the batch came
    after one or more that were never seen (None otherwise); `restarted` when the
    publisher's numbering went back (it restarted, so its old entries were dropped)."""

    stored: int = 0
    removed: int = 0
    cleared: bool = False
    gap: int | None = None
    restarted: bool = False
    dropped: int = 0
    malformed: int = 0  # events or hashes not in vLLM's form, skipped


@dataclass
class _Replica:
    slot: int
    next_seq: int | None = None  # the sequence number expected next; None before any
    last_live: int | None = None  # the last sequence number seen on the live stream
    block_size: int | None = None  # tokens per block, as its BlockStored events say
    entries: int = 0
    overflowed: bool = False
    hashes: set[int] = field(default_factory=set)  # what it holds: clearing costs only these
    removed_at: float = -math.inf  # clock time of the last removal its events announced


@dataclass
class KVIndex:
    """Exact map from a block's 64-bit hash to the replicas (by URL) that hold it."""

    capacity: int = 4_000_000
    per_replica: int = 1 << 20
    clock: Callable[[], float] = field(default=time.monotonic)
    # hash -> a bit per replica slot holding it; any dict will do (a test passes one that
    # counts the entries an operation touches)
    owners: dict[int, int] = field(default_factory=dict)
    _replicas: dict[str, _Replica] = field(default_factory=dict)
    dropped_total: int = 0
    lower: LowerTiers = field(default_factory=LowerTiers)  # offload tiers' blocks

    # ------------------------------------------------------------------ replicas
    def _replica(self, url: str) -> _Replica:
        replica = self._replicas.get(url)
        if replica is None:
            used = {r.slot for r in self._replicas.values()}
            slot = next(i for i in range(MAX_REPLICAS + 1) if i not in used)
            if slot >= MAX_REPLICAS:
                raise ValueError(f"more than {MAX_REPLICAS} replicas in one KV index")
            replica = self._replicas[url] = _Replica(slot)
        return replica

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def forget(self, url: str) -> None:
        """Drop everything known of `url` (it left, or its events cannot be trusted)."""
        replica = self._replicas.pop(url, None)
        if replica is not None:
            self._clear(replica)
            self.lower.clear(replica.slot)

    def _clear(self, replica: _Replica) -> None:
        for _ in self._clear_steps(replica):
            pass

    def _clear_steps(self, replica: _Replica) -> Generator[None, None, None]:
        """Drop `replica`'s entries, yielding every SLICE of them: the cost is its own
        entries, never the whole index (another replica's clear does not scan yours)."""
        held = replica.hashes
        keep = ~(1 << replica.slot)
        owners = self.owners
        for i, h in enumerate(list(held), 1):  # a clear cut short (forget) finishes it
            held.discard(h)
            replica.entries -= 1
            mask = owners.get(h, 0) & keep
            if mask:
                owners[h] = mask
            else:
                owners.pop(h, None)
            if i % SLICE == 0:
                yield
        replica.entries = 0
        replica.overflowed = False

    def next_seq(self, url: str) -> int | None:
        replica = self._replicas.get(url)
        return None if replica is None else replica.next_seq

    def block_size(self, url: str) -> int | None:
        replica = self._replicas.get(url)
        return None if replica is None else replica.block_size

    def removed_at(self, url: str) -> float:
        """When `url`'s events last announced a removal (`clock` time; -inf if never)."""
        replica = self._replicas.get(url)
        return -math.inf if replica is None else replica.removed_at

    def overflowed(self, url: str) -> bool:
        replica = self._replicas.get(url)
        return replica is not None and replica.overflowed

    def entries(self, url: str | None = None) -> int:
        """Block entries held by `url`, or distinct hashes in the whole index."""
        if url is None:
            return len(self.owners)
        replica = self._replicas.get(url)
        return 0 if replica is None else replica.entries

    # ------------------------------------------------------------------ events
    def apply(self, url: str, seq: int, batch: Sequence[Any], live: bool = True) -> Applied:
        """Apply one decoded event batch `[ts, events, rank]` numbered `seq` from `url`.

        `live` batches come from the PUB stream, whose numbering only grows while the
        publisher lives: one at or below the last live batch means the publisher restarted
        (the replica's entries are reset first). Otherwise a batch below the one expected
        was applied already through replay and is skipped, and one above it leaves a gap."""
        steps = self.steps(url, seq, batch, live)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def steps(
        self, url: str, seq: int, batch: Sequence[Any], live: bool = True
    ) -> Generator[None, None, Applied]:
        """`apply` in slices: yields after every SLICE hashes (stored, removed or cleared),
        returns what the batch did. The subscriber yields to the event loop at each step."""
        replica = self._replica(url)
        applied = Applied()
        if live and replica.last_live is not None and seq <= replica.last_live:
            applied.restarted = True
            yield from self._clear_steps(replica)
            self.lower.clear(replica.slot)
            replica.next_seq = None
        if live:
            replica.last_live = seq
        expected = replica.next_seq
        if expected is not None and seq < expected:
            return applied
        if expected is not None and seq > expected:
            applied.gap = expected
        replica.next_seq = seq + 1
        events = batch[1] if isinstance(batch, list | tuple) and len(batch) > 1 else ()
        if not isinstance(events, list | tuple):
            applied.malformed += 1
            events = ()
        for event in events:
            yield from self._event(replica, event, applied)
        if applied.removed or applied.cleared or applied.restarted:
            replica.removed_at = self.clock()
        return applied

    def _event(self, replica: _Replica, event: Any, applied: Applied) -> Generator[None]:
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "AllBlocksCleared":
            yield from self._clear_steps(replica)
            applied.cleared = True
            return
        if kind not in ("BlockStored", "BlockRemoved"):
            applied.malformed += kind is None
            return
        hashes = event.get("block_hashes") or ()
        if not isinstance(hashes, list | tuple):
            applied.malformed += 1
            return
        medium = event.get("medium")
        if medium in LOWER:  # an offload tier's block (kv_tier_index)
            valid = [h for h in map(block_hash, hashes[: self.per_replica]) if h is not None]
            applied.malformed += len(hashes[: self.per_replica]) - len(valid)
            changed = self.lower.apply(replica.slot, kind, medium, valid)
            if kind == "BlockStored":
                applied.stored += changed
            else:
                applied.removed += changed
            return
        bit = 1 << replica.slot
        owners = self.owners
        held = replica.hashes
        if kind == "BlockStored":
            size = event.get("block_size")
            if type(size) is int and 0 < size <= MAX_BLOCK_SIZE:
                replica.block_size = size
            for i, value in enumerate(hashes, 1):
                if i % SLICE == 0:
                    yield
                h = block_hash(value)
                if h is None:
                    applied.malformed += 1
                    continue
                if h in held:
                    continue
                if replica.entries >= self.per_replica:  # its share is full: the rest drop
                    left = len(hashes) - i + 1
                    applied.dropped += left
                    self.dropped_total += left
                    replica.overflowed = True
                    return
                mask = owners.get(h)
                if mask is None:
                    if len(owners) >= self.capacity:
                        applied.dropped += 1
                        self.dropped_total += 1
                        replica.overflowed = True
                        continue
                    owners[h] = bit
                else:
                    owners[h] = mask | bit
                held.add(h)
                replica.entries += 1
                applied.stored += 1
        else:
            for i, value in enumerate(hashes, 1):
                if i % SLICE == 0:
                    yield
                h = block_hash(value)
                if h is None:
                    applied.malformed += 1
                    continue
                if h not in held:
                    continue
                held.discard(h)
                mask = owners.get(h, 0) & ~bit
                if mask:
                    owners[h] = mask
                else:
                    owners.pop(h, None)
                replica.entries -= 1
                applied.removed += 1

    # ------------------------------------------------------------------ lookups
    def hashes(self, url: str) -> set[int]:
        """Every block hash `url` holds (a copy: for tests and diagnosis)."""
        replica = self._replicas.get(url)
        return set() if replica is None else set(replica.hashes)

    def matched_by_tier(self, url: str, hashes: Sequence[int]) -> tuple[int, int, int]:
        """(GPU, host, disk) blocks of the chain's longest prefix `url` holds in any tier
        (kv_tier_index.matched_by_tier says the order)."""
        replica = self._replicas.get(url)
        if replica is None:
            return 0, 0, 0
        bit = 1 << replica.slot
        owners = self.owners
        on_gpu = [bool(owners.get(h, 0) & bit) for h in hashes]
        lower = [self.lower.tiers(replica.slot, h) for h in hashes]
        return matched_by_tier(on_gpu, lower)

    def matched(self, url: str, hashes: Sequence[int]) -> int:
        """How many of the chain's first blocks `url` holds (stops at the first miss: a
        block is usable only after its whole prefix)."""
        replica = self._replicas.get(url)
        if replica is None:
            return 0
        bit = 1 << replica.slot
        owners = self.owners
        count = 0
        for h in hashes:
            if not owners.get(h, 0) & bit:
                break
            count += 1
        return count


# ---------------------------------------------------------------------- the I/O half


def decode(payload: bytes) -> list[Any]:
    """A batch payload as plain values (msgspec's msgpack decoder, a vLLM dependency)."""
    return kv_blocks.decode_batch(payload)


@dataclass(frozen=True)
class EventAddress:
    publish: str  # tcp://host:port of the PUB socket
    replay: str  # tcp://host:port+1 of the ROUTER socket


def event_address(url: str, port: int) -> EventAddress:
    """Where the engine at `url` publishes (launcher.kv_events_args: port, port + 1)."""
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return EventAddress(f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}")


class KVEventsSubscriber:
    """Keeps `index` in step with the events of each replica given to `sync`.

    Per replica: a SUB socket for the live stream, and a replay probe every
    `probe_interval` seconds (and at once after a gap) asking for everything from the
    next expected sequence number. A probe answered (with the end marker) within
    `probe_timeout` marks the replica fresh for `stale_after` seconds; a gap the replay
    cannot fill (the publisher's buffer no longer holds it) resets the replica, whose
    entries then rebuild from new events. `fresh(url)` is False for a replica never
    synced, one whose probe went unanswered, or one whose index overflowed.
    """

    def __init__(
        self,
        index: KVIndex,
        *,
        probe_interval: float = 2.0,
        probe_timeout: float = 1.0,
        stale_after: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.index = index
        self.max_message_bytes = max_message_bytes
        self.malformed = 0  # batches, events or hashes skipped as not in vLLM's form
        self._warned: dict[str, float] = {}  # url -> when a malformed batch was last logged
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.stale_after = stale_after
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._addresses: dict[str, EventAddress] = {}
        self._fresh_until: dict[str, float] = {}
        self.gaps = {"replayed": 0, "lost": 0}
        self.restarts = 0
        self._ctx: Any = None

    def fresh(self, url: str) -> bool:
        return self._fresh_until.get(url, 0.0) > self.clock() and not self.index.overflowed(url)

    def sync(self, addresses: dict[str, EventAddress]) -> None:
        """Subscribe to the replicas in `addresses` (URL -> event address), drop the rest.
        Call from the event loop whenever the set of ready replicas changes."""
        for url, task in list(self._tasks.items()):
            moved = url not in addresses or addresses[url] != self._addresses.get(url)
            if moved or task.done():  # a follower that stopped on an error starts again
                self._stop(url)
        for url, address in addresses.items():
            if url not in self._tasks:
                self._addresses[url] = address
                self._tasks[url] = asyncio.get_running_loop().create_task(
                    self._follow(url, address), name=f"kv-events {url}"
                )

    def _stop(self, url: str) -> None:
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()
        self._addresses.pop(url, None)
        self._fresh_until.pop(url, None)
        self.index.forget(url)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for url in list(self._tasks):
            self._stop(url)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _context(self) -> Any:
        if self._ctx is None:
            import zmq.asyncio  # pyzmq, a vLLM dependency: the gateway's `precise` extra

            self._ctx = zmq.asyncio.Context.instance()
        return self._ctx

    async def _follow(self, url: str, address: EventAddress) -> None:
        import zmq
        import zmq.asyncio

        sub = self._context().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        # ZMQ drops a connection that sent a message over the maximum size and, as for any
        # protocol error, never reconnects it: the follower ends on a disconnect and
        # `sync` starts a new one (the replica rebuilt through replay meanwhile).
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sub.connect(address.publish)
        try:
            next_probe = 0.0
            while True:
                now = self.clock()
                if now >= next_probe:
                    await self._probe(url, address)
                    next_probe = self.clock() + self.probe_interval
                wait_ms = max(1, int((next_probe - self.clock()) * 1000))
                ready = dict(await poller.poll(wait_ms))
                if monitor in ready:
                    log.warning(
                        "KV events of %s: the publisher's connection dropped (it stopped, or "
                        "sent a message over %d bytes); following again",
                        url, self.max_message_bytes,
                    )  # fmt: skip
                    self._fresh_until.pop(url, None)
                    return
                if sub not in ready:
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                if await self.take(url, frames[1], frames[2]):
                    await self._probe(url, address)  # a gap: catch up through replay
                    next_probe = self.clock() + self.probe_interval
        except asyncio.CancelledError:
            raise
        except Exception:  # never let one replica's stream take the gateway down
            log.exception("KV events of %s: subscriber stopped", url)
            self._fresh_until.pop(url, None)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def take(self, url: str, seq_bytes: bytes, payload: bytes, live: bool = True) -> bool:
        """Apply one batch (a publisher's sequence-number and payload frames), yielding to the
        event loop between slices; True when it revealed a gap. A batch that is not in vLLM's
        form is skipped (logged at most once a minute per replica), never an error that would
        restart the subscriber."""
        if len(seq_bytes) != 8:
            self._malformed(url, "a sequence number that is not 8 bytes")
            return False
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        try:
            batch = decode(payload)
        except Exception:
            self._malformed(url, f"undecodable batch {seq}")
            return False
        steps = self.index.steps(url, seq, batch, live)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                applied: Applied = done.value
                break
            await asyncio.sleep(0)  # a big batch in slices: other requests run between
        if applied.malformed:
            self._malformed(url, f"{applied.malformed} malformed entries in batch {seq}")
        if applied.restarted:
            self.restarts += 1
        return applied.gap is not None

    def _malformed(self, url: str, what: str) -> None:
        self.malformed += 1
        now = self.clock()
        if now - self._warned.get(url, -math.inf) >= 60.0:
            self._warned[url] = now
            log.warning("KV events of %s: %s skipped (logged once a minute)", url, what)

    async def _probe(self, url: str, address: EventAddress) -> None:
        """Ask the replay socket for everything from the next expected batch; fresh when it
        answers in time. A replay starting past the expected batch means events were lost."""
        import zmq

        expected = self.index.next_seq(url)
        start = 0 if expected is None else expected
        dealer = self._context().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        dealer.connect(address.replay)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = self.clock() + self.probe_timeout
            first: int | None = None
            while True:
                left = deadline - self.clock()
                if left <= 0 or not await dealer.poll(max(1, int(left * 1000))):
                    self._fresh_until.pop(url, None)
                    return
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                if first is None:
                    first = seq
                    if expected is not None and seq > expected:
                        self.gaps["lost"] += 1
                        self.index.forget(url)  # what we missed is gone: start over
                        expected = None
                    elif expected is not None and seq <= expected:
                        self.gaps["replayed"] += 1
                await self.take(url, frames[2], frames[3], live=False)
            self._fresh_until[url] = self.clock() + self.stale_after
        finally:
            dealer.close(linger=0)


def ready_addresses(urls: Iterable[str], port: int) -> dict[str, EventAddress]:
    """The event address of each ready replica URL, for `KVEventsSubscriber.sync`."""
    return {url: event_address(url, port) for url in urls}
