"""The simulator publishes KV-cache events as vLLM does: the same msgpack encoding, block
hashes the gateway computes for the same prompt, sequence numbers and a replay socket;
the gateway's subscriber, following it, holds exactly what the simulator's cache holds
through stores and evictions."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import httpx
import pytest
from kubellm.engine.sim import create_app
from kubellm.engine.sim_core import Engine, Request
from kubellm.engine.sim_profiles import get as get_profile
from kubellm.gateway.routing.index.kv_events import KVEventsSubscriber, KVIndex, event_address
from kubellm.gateway.routing.index.kv_hashes import BlockHasher, SimPromptTokenizer

from kubellm import kv_blocks
from tests.fixtures.engines import free_port
from tests.fixtures.polling import eventually

URL = "http://127.0.0.1:8000"  # the events are looked for on its host
BLOCK = 16


def _cached(app: Any) -> set[int]:
    """The 64-bit hashes of every block the simulator's prefix cache holds."""
    return {kv_blocks.external(h) for h in app.state.simulator.engine.pool.cached}


def _prompt(i: int) -> str:
    return f"tenant {i:03d} " + " ".join(f"w{i}-{j}" for j in range(55))  # ~5 blocks


def test_events_follow_the_cache_in_the_core() -> None:
    """Stores name the blocks in chain order with their parent; an eviction is announced
    once the hash leaves the cache; a reset clears everything."""
    profile = get_profile("tiny-cpu").with_overrides(block_size=4, num_blocks=6)
    engine = Engine(profile, kv_events=True)
    engine.add(Request("a", list(range(100, 113)), 2))  # 13 tokens: 3 full blocks
    while engine.has_work:
        engine.step()
    events = engine.take_events()
    stored = [e for e in events if e["type"] == "BlockStored"]
    hashes = [h for e in stored for h in e["block_hashes"]]
    expected = BlockHasher(4).block_hashes(list(range(100, 113)))
    assert hashes[:3] == list(expected)  # the prompt's blocks, as the gateway hashes them
    assert stored[0]["parent_block_hash"] is None and stored[0]["block_size"] == 4
    assert set(hashes) == {kv_blocks.external(h) for h in engine.pool.cached}
    engine.add(Request("b", list(range(500, 521)), 2))  # 6 blocks: evicts all of a's
    while engine.has_work:
        engine.step()
    removed = {h for e in engine.take_events() if e["type"] == "BlockRemoved"
               for h in e["block_hashes"]}  # fmt: skip
    assert set(expected) <= removed
    assert engine.reset_prefix_cache()
    assert engine.take_events() == [{"type": "AllBlocksCleared"}]
    assert not engine.pool.cached


def test_adapter_and_salted_requests_hash_with_vllms_extra_keys() -> None:
    """A LoRA request's blocks carry ("lora", name, path), a cache salt block 0's: the
    same prompt under an adapter or a salt is a different chain (no false hits)."""
    profile = get_profile("tiny-cpu").with_overrides(block_size=4, num_blocks=40, max_loras=1)
    engine = Engine(profile, kv_events=True)
    tokens = list(range(100, 113))
    engine.add(Request("lora", tokens, 1, lora="sql", lora_path="/models/adapters/sql"))
    engine.add(Request("salt", tokens, 1, cache_salt="tenant-7"))
    while engine.has_work:
        engine.step()
    stored = {h for e in engine.take_events() if e["type"] == "BlockStored"
              for h in e["block_hashes"]}  # fmt: skip
    hasher = BlockHasher(4)
    assert set(hasher.block_hashes(tokens, lora=("sql", "/models/adapters/sql"))) <= stored
    assert set(hasher.block_hashes(tokens, cache_salt="tenant-7")) <= stored
    assert not set(hasher.block_hashes(tokens)) & stored  # no base-model block was stored
    assert engine.prefix_hits == 0


async def test_the_subscribers_index_equals_the_sims_cache_through_evictions() -> None:
    port = free_port()
    while port + 1 == (other := free_port()):  # the replay port is the next one: keep it free
        port = other
    app = create_app(
        "m", "tiny-cpu", time_scale=0, block_size=BLOCK, num_blocks=14,
        kv_events=("127.0.0.1", port),
    )  # fmt: skip
    index = KVIndex()
    subscriber = KVEventsSubscriber(index, probe_interval=0.2, probe_timeout=1.0)
    tokenizer, hasher = SimPromptTokenizer(), BlockHasher(BLOCK)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url=URL) as client:
            # one request before subscribing: only the replay socket can deliver its events
            body = {"model": "m", "prompt": _prompt(0), "max_tokens": 4}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            subscriber.sync({URL: event_address(URL, port)})
            await eventually(lambda: index.entries(URL) == len(_cached(app)), 10, "the replay")
            await eventually(lambda: subscriber.fresh(URL), 10, "the replica to be fresh")
            publisher = app.state.simulator.publisher
            for i in range(1, 7):  # 6 x ~5 blocks through a 14-block pool: evictions
                body = {"model": "m", "prompt": _prompt(i), "max_tokens": 4}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                await eventually(
                    lambda: index.next_seq(URL) == publisher.published, 10, "the batches"
                )
                assert index.hashes(URL) == _cached(app)
                token_ids = tokenizer.token_ids(body)
                assert token_ids == app.state.simulator.tokenizer.encode(_prompt(i))
                prompt_blocks = hasher.block_hashes(token_ids)
                assert index.matched(URL, prompt_blocks) == len(prompt_blocks) > 0
            first = hasher.block_hashes(tokenizer.token_ids({"prompt": _prompt(0)}) or [])
            assert index.matched(URL, first) == 0  # evicted, and the index knows it
            chat = {"model": "m", "messages": [{"role": "user", "content": _prompt(9)}]}
            assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
            await eventually(
                lambda: index.next_seq(URL) == publisher.published, 10, "the chat batch"
            )
            chat_blocks = hasher.block_hashes(tokenizer.token_ids(chat) or [])
            assert index.matched(URL, chat_blocks) == len(chat_blocks) > 0
            assert (await client.post("/reset_prefix_cache")).status_code == 200
            await eventually(lambda: index.entries(URL) == 0, 10, "the cleared cache")
            assert not _cached(app)
    finally:
        await subscriber.close()
        await app.state.simulator.stop()


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="compares with vLLM's own encoder"
)


@needs_vllm
def test_the_encoding_is_vllms(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Byte for byte what vLLM's publisher sends for the same batch."""
    from kubellm.engine import launcher

    if launcher.torchcodec_broken():
        sys.path.insert(0, launcher.write_torchcodec_shim(tmp_path_factory.mktemp("shim")))
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    theirs = KVEventBatch(
        ts=12.5,
        events=[
            BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[5] * 32,
                        block_size=16, lora_id=None, medium="GPU", lora_name=None),
            BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=[6] * 16,
                        block_size=16, lora_id=None, medium="GPU", lora_name="sql"),
            BlockRemoved(block_hashes=[1], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    ours = kv_blocks.encode_batch(
        12.5,
        [
            kv_blocks.block_stored([1, 2], None, [5] * 32, 16),
            kv_blocks.block_stored([3], 2, [6] * 16, 16, "sql"),
            kv_blocks.block_removed([1]),
            kv_blocks.all_blocks_cleared(),
        ],
    )
    assert ours == msgspec.msgpack.Encoder().encode(theirs)
