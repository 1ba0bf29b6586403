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
slots (replicas are numbered per index, at most `MAX_REPLICAS`); measured with
tracemalloc in tests/gateway/routing/test_kv_index.py and printed by bench/kv_index_memory.py
(about 100 bytes an entry). The map is bounded by `capacity` entries (default 4 M,
about 400 MB at worst): a store past it is dropped and counted, and the replica that
lost it is no longer fresh until its cache is cleared or it restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubellm import kv_blocks

log = logging.getLogger(__name__)

MAX_REPLICAS = 1024
END_SEQ = kv_blocks.END_SEQ


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


@dataclass
class _Replica:
    slot: int
    next_seq: int | None = None  # the sequence number expected next; None before any
    last_live: int | None = None  # the last sequence number seen on the live stream
    block_size: int | None = None  # tokens per block, as its BlockStored events say
    entries: int = 0
    overflowed: bool = False
    removed_at: float = -math.inf  # clock time of the last removal its events announced


@dataclass
class KVIndex:
    """Exact map from a block's 64-bit hash to the replicas (by URL) that hold it."""

    capacity: int = 4_000_000
    clock: Callable[[], float] = field(default=time.monotonic)
    _owners: dict[int, int] = field(default_factory=dict)
    _replicas: dict[str, _Replica] = field(default_factory=dict)
    dropped_total: int = 0

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

    def _clear(self, replica: _Replica) -> None:
        bit = 1 << replica.slot
        if replica.entries:
            owners = self._owners
            for h in [h for h, mask in owners.items() if mask & bit]:
                mask = owners[h] & ~bit
                if mask:
                    owners[h] = mask
                else:
                    del owners[h]
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
            return len(self._owners)
        replica = self._replicas.get(url)
        return 0 if replica is None else replica.entries

    # ------------------------------------------------------------------ events
    def apply(self, url: str, seq: int, batch: Sequence[Any], live: bool = True) -> Applied:
        """Apply one decoded event batch `[ts, events, rank]` numbered `seq` from `url`.

        `live` batches come from the PUB stream, whose numbering only grows while the
        publisher lives: one at or below the last live batch means the publisher restarted
        (the replica's entries are reset first). Otherwise a batch below the one expected
        was applied already through replay and is skipped, and one above it leaves a gap."""
        replica = self._replica(url)
        applied = Applied()
        if live and replica.last_live is not None and seq <= replica.last_live:
            applied.restarted = True
            self._clear(replica)
            replica.next_seq = None
        if live:
            replica.last_live = seq
        expected = replica.next_seq
        if expected is not None and seq < expected:
            return applied
        if expected is not None and seq > expected:
            applied.gap = expected
        replica.next_seq = seq + 1
        events = batch[1] if len(batch) > 1 else ()
        for event in events:
            self._event(replica, event, applied)
        if applied.removed or applied.cleared or applied.restarted:
            replica.removed_at = self.clock()
        return applied

    def _event(self, replica: _Replica, event: Any, applied: Applied) -> None:
        kind = event.get("type") if isinstance(event, dict) else None
        bit = 1 << replica.slot
        owners = self._owners
        if kind == "BlockStored":
            size = event.get("block_size")
            if isinstance(size, int) and size > 0:
                replica.block_size = size
            for h in event.get("block_hashes") or ():
                mask = owners.get(h)
                if mask is None:
                    if len(owners) >= self.capacity:
                        applied.dropped += 1
                        self.dropped_total += 1
                        replica.overflowed = True
                        continue
                    owners[h] = bit
                elif mask & bit:
                    continue
                else:
                    owners[h] = mask | bit
                replica.entries += 1
                applied.stored += 1
        elif kind == "BlockRemoved":
            for h in event.get("block_hashes") or ():
                mask = owners.get(h)
                if mask is None or not mask & bit:
                    continue
                mask &= ~bit
                if mask:
                    owners[h] = mask
                else:
                    del owners[h]
                replica.entries -= 1
                applied.removed += 1
        elif kind == "AllBlocksCleared":
            self._clear(replica)
            applied.cleared = True

    # ------------------------------------------------------------------ lookups
    def hashes(self, url: str) -> set[int]:
        """Every block hash `url` holds (a full scan: for tests and diagnosis)."""
        replica = self._replicas.get(url)
        if replica is None:
            return set()
        bit = 1 << replica.slot
        return {h for h, mask in self._owners.items() if mask & bit}

    def matched(self, url: str, hashes: Sequence[int]) -> int:
        """How many of the chain's first blocks `url` holds (stops at the first miss: a
        block is usable only after its whole prefix)."""
        replica = self._replicas.get(url)
        if replica is None:
            return 0
        bit = 1 << replica.slot
        owners = self._owners
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
    ) -> None:
        self.index = index
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

        sub = self._context().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(address.publish)
        try:
            next_probe = 0.0
            while True:
                now = self.clock()
                if now >= next_probe:
                    await self._probe(url, address)
                    next_probe = self.clock() + self.probe_interval
                wait_ms = max(1, int((next_probe - self.clock()) * 1000))
                if not await sub.poll(wait_ms):
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                if self._take(url, frames[1], frames[2]):
                    await self._probe(url, address)  # a gap: catch up through replay
                    next_probe = self.clock() + self.probe_interval
        except asyncio.CancelledError:
            raise
        except Exception:  # never let one replica's stream take the gateway down
            log.exception("KV events of %s: subscriber stopped", url)
            self._fresh_until.pop(url, None)
        finally:
            sub.close(linger=0)

    def _take(self, url: str, seq_bytes: bytes, payload: bytes, live: bool = True) -> bool:
        """Apply one batch; True when it revealed a gap."""
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        try:
            batch = decode(payload)
        except Exception:
            log.warning("KV events of %s: undecodable batch %d skipped", url, seq)
            return False
        applied = self.index.apply(url, seq, batch, live)
        if applied.restarted:
            self.restarts += 1
        return applied.gap is not None

    async def _probe(self, url: str, address: EventAddress) -> None:
        """Ask the replay socket for everything from the next expected batch; fresh when it
        answers in time. A replay starting past the expected batch means events were lost."""
        import zmq

        expected = self.index.next_seq(url)
        start = 0 if expected is None else expected
        dealer = self._context().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
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
                self._take(url, frames[2], frames[3], live=False)
            self._fresh_until[url] = self.clock() + self.stale_after
        finally:
            dealer.close(linger=0)


def ready_addresses(urls: Iterable[str], port: int) -> dict[str, EventAddress]:
    """The event address of each ready replica URL, for `KVEventsSubscriber.sync`."""
    return {url: event_address(url, port) for url in urls}
