"""The precise prefix index: exact block ownership from KV events, gaps, restarts, bounds,
and the subscriber against vLLM's own ZMQ publisher (its PUB and replay sockets)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
import tracemalloc

import pytest
from kubellm.gateway.routing.index.kv_events import EventAddress, KVEventsSubscriber, KVIndex

from tests.fixtures.engines import free_port

A, B = "http://a:8000", "http://b:8000"


def stored(*hashes: int) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes)}


def removed(*hashes: int) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes)}


def batch(*events: dict) -> list:
    return [0.0, list(events), 0]


def test_stored_blocks_match_as_a_chain_per_replica() -> None:
    index = KVIndex()
    index.apply(A, 0, batch(stored(1, 2, 3)))
    index.apply(B, 0, batch(stored(1)))
    assert index.matched(A, [1, 2, 3, 4]) == 3
    assert index.matched(B, [1, 2, 3]) == 1
    assert index.matched(A, [2, 3]) == 2
    assert index.matched(A, [9, 1]) == 0  # a chain stops at its first miss
    assert index.matched("http://never:1", [1]) == 0


def test_removed_and_cleared_blocks_stop_matching_only_on_their_replica() -> None:
    index = KVIndex()
    index.apply(A, 0, batch(stored(1, 2, 3)))
    index.apply(B, 0, batch(stored(1, 2)))
    index.apply(A, 1, batch(removed(2)))
    assert index.matched(A, [1, 2, 3]) == 1
    assert index.matched(B, [1, 2, 3]) == 2
    assert index.entries(A) == 2 and index.entries() == 3
    index.apply(B, 1, batch({"type": "AllBlocksCleared"}))
    assert index.matched(B, [1]) == 0 and index.matched(A, [1]) == 1
    assert index.entries() == 2  # hash 2 left the map with its last holder


def test_a_sequence_gap_is_reported_and_a_replayed_batch_is_not_applied_twice() -> None:
    index = KVIndex()
    assert index.apply(A, 0, batch(stored(1))).gap is None
    applied = index.apply(A, 3, batch(stored(4)))
    assert applied.gap == 1  # batches 1 and 2 never arrived
    # Replay fills 1..2; the live stream then delivers 4 again: skipped.
    index.apply(A, 1, batch(stored(2)), live=False)
    index.apply(A, 2, batch(removed(2)), live=False)
    assert index.apply(A, 3, batch(stored(4)), live=False).stored == 0
    assert index.next_seq(A) == 4
    assert index.matched(A, [1, 2]) == 1


def test_a_restarted_publisher_resets_the_replica() -> None:
    index = KVIndex()
    index.apply(A, 0, batch(stored(1, 2)))
    index.apply(A, 1, batch(stored(3)))
    applied = index.apply(A, 0, batch(stored(7)))  # numbering went back: a new engine
    assert applied.restarted
    assert index.matched(A, [1]) == 0 and index.matched(A, [7]) == 1


def test_forget_drops_a_leaving_replica_and_frees_its_slot() -> None:
    index = KVIndex()
    index.apply(A, 0, batch(stored(1, 2)))
    index.apply(B, 0, batch(stored(2)))
    index.forget(A)
    assert index.replicas() == [B] and index.entries() == 1
    index.apply("http://c:8000", 0, batch(stored(1)))
    assert index.matched("http://c:8000", [1]) == 1 and index.matched(B, [1]) == 0


def test_capacity_bounds_the_map_and_marks_the_replica_that_lost_stores() -> None:
    index = KVIndex(capacity=3)
    index.apply(A, 0, batch(stored(1, 2, 3)))
    applied = index.apply(B, 0, batch(stored(1, 4)))  # 1 is shared: no new entry
    assert (applied.stored, applied.dropped) == (1, 1)
    assert index.entries() == 3 and index.overflowed(B) and not index.overflowed(A)
    index.apply(B, 1, batch({"type": "AllBlocksCleared"}))
    assert not index.overflowed(B)


def test_malformed_events_are_ignored() -> None:
    index = KVIndex()
    index.apply(A, 0, [0.0, ["junk", {"type": "Other"}, {"type": "BlockStored"}, stored(5)]])
    assert index.matched(A, [5]) == 1


def test_memory_per_entry_is_measured(capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes per block entry, and what an 8-replica fleet of 80 GB GPUs needs."""
    n = 200_000
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index = KVIndex()
    base = 1 << 63  # 64-bit hashes, as vLLM publishes them
    for seq in range(n // 1000):
        hashes = range(base + seq * 1000, base + (seq + 1) * 1000)
        index.apply(f"http://r{seq % 8}:8000", seq // 8, batch(stored(*hashes)))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(s.size_diff for s in after.compare_to(before, "filename"))
    per_entry = used / n
    # 8B model (Llama 3 8B: 32 layers, 8 KV heads of 128, bf16: 128 KiB a token), 80 GB
    # at 0.9 less 16 GB of weights: 64 GiB of KV = 512 Ki tokens = 32 Ki blocks of 16 per
    # GPU; 8 GPUs, no block shared between them (the worst case): 256 Ki entries.
    fleet_entries = 8 * (64 * 2**30 // (128 * 2**10)) // 16
    with capsys.disabled():
        print(
            f"\nKV index: {per_entry:.0f} bytes per block entry; 8 x 80 GB replicas "
            f"(8B model, 16-token blocks) = {fleet_entries:,} entries = "
            f"{fleet_entries * per_entry / 2**20:.0f} MiB"
        )
    assert index.entries() == n
    assert per_entry < 200  # a dict slot + a 64-bit int key + a small int mask


# ------------------------------------------------------------------ the subscriber, for real

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM's ZmqEventPublisher is the peer"
)


@pytest.fixture(autouse=True, scope="module")
def _importable_vllm(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM's CPU build imports torchcodec, whose library cannot load here: the launcher's
    stand-in makes it an ImportError, as it does for the engine."""
    from kubellm.engine import launcher

    if launcher.torchcodec_broken():
        sys.path.insert(0, launcher.write_torchcodec_shim(tmp_path_factory.mktemp("shim")))


def _publisher(pub_port: int, replay_port: int, buffer_steps: int = 100):
    from vllm.distributed.kv_events import ZmqEventPublisher

    return ZmqEventPublisher(
        0,
        endpoint=f"tcp://[::ffff:127.0.0.1]:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        buffer_steps=buffer_steps,
    )


def _kv_batch(*events: object):
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=time.time(), events=list(events))


def _stored(*hashes: int):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16,
        lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip


async def _until(condition, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@needs_vllm
async def test_subscriber_follows_vllms_publisher_and_catches_up_through_replay() -> None:
    from vllm.distributed.kv_events import BlockRemoved

    pub_port, replay_port = free_port(), free_port()
    publisher = _publisher(pub_port, replay_port)
    index = KVIndex()
    subscriber = KVEventsSubscriber(index, probe_interval=0.2, probe_timeout=1.0)
    address = EventAddress(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        # Published before anyone subscribed: only the replay socket can deliver these.
        publisher.publish(_kv_batch(_stored(11, 12)))
        publisher.publish(_kv_batch(_stored(13)))
        subscriber.sync({A: address})
        await _until(lambda: index.matched(A, [11, 12, 13]) == 3, what="replayed batches")
        # fresh once a probe of the replay socket has been answered (not at the same instant)
        await _until(lambda: subscriber.fresh(A), what="the replica to be fresh")
        publisher.publish(_kv_batch(BlockRemoved(block_hashes=[12], medium="GPU")))
        await _until(lambda: index.matched(A, [11, 12]) == 1, what="the live removal")
        subscriber.sync({})  # the replica left: its entries go
        assert index.entries() == 0 and not subscriber.fresh(A)
    finally:
        await subscriber.close()
        publisher.shutdown()


@needs_vllm
async def test_an_unanswered_probe_makes_the_replica_stale() -> None:
    pub_port, replay_port = free_port(), free_port()
    publisher = _publisher(pub_port, replay_port)
    index = KVIndex()
    subscriber = KVEventsSubscriber(index, probe_interval=0.1, probe_timeout=0.3, stale_after=0.5)
    address = EventAddress(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        subscriber.sync({A: address})
        await _until(lambda: subscriber.fresh(A), what="the first probe")
        publisher.shutdown()  # the engine's publisher is gone
        await _until(lambda: not subscriber.fresh(A), what="staleness")
    finally:
        await subscriber.close()


def _first_replayed(replay_port: int) -> int | None:
    """The first sequence number the replay socket still holds (None: none, or no answer)."""
    import zmq

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        if not dealer.poll(1000):
            return None
        seq = int.from_bytes(dealer.recv_multipart()[2], "big", signed=True)
        return None if seq == -1 else seq
    finally:
        dealer.close(linger=0)


@needs_vllm
async def test_a_gap_past_the_replay_buffer_resets_the_replica() -> None:
    pub_port, replay_port = free_port(), free_port()
    publisher = _publisher(pub_port, replay_port, buffer_steps=2)
    index = KVIndex()
    subscriber = KVEventsSubscriber(index, probe_interval=0.2)
    address = EventAddress(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        for h in (1, 2, 3, 4):  # only 3 and 4 stay in the 2-batch replay buffer
            publisher.publish(_kv_batch(_stored(h)))
        # The publisher's thread numbers and buffers them: wait until batch 1 has left it.
        await _until(lambda: _first_replayed(replay_port) == 2, what="the buffer to roll")
        index.apply(A, 0, batch(stored(1)))  # as if batch 0 had been seen live
        subscriber.sync({A: address})
        await _until(lambda: subscriber.gaps["lost"] == 1, what="the lost gap")
        await _until(lambda: index.matched(A, [3]) == 1, what="the replayed batches")
        assert index.matched(A, [1]) == 0  # stale knowledge was dropped, not kept
    finally:
        await subscriber.close()
        publisher.shutdown()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
