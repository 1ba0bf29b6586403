"""The simulated replica's KV offload tiers (engine_image/sim_tiers.py): evicted prefixes
come back from host memory (or disk) at a reload's cost instead of a prefill's, hits are
counted by tier, KV events carry the tier's medium byte-equal to vLLM's own event classes,
and the offload metrics carry vLLM's names."""

from __future__ import annotations

import importlib.util

import pytest
from kubellm.engine.sim_core import Engine, Request
from kubellm.engine.sim_profiles import get as get_profile
from kubellm.engine.sim_tiers import OffloadTiers

from kubellm import kv_blocks, kv_tiers

BLOCK = 4
PER_TOKEN = 1024  # KV bytes per token: a block is 4 KiB


def engine(host_blocks: int = 0, disk_blocks: int = 0, events: bool = False) -> Engine:
    profile = get_profile("tiny-cpu").with_overrides(
        block_size=BLOCK, num_blocks=8, kv_bytes_per_token=PER_TOKEN,
        host_tier_blocks=host_blocks, disk_tier_blocks=disk_blocks,
        host_gbps=1e-3, disk_read_gbps=1e-4,  # slow links: a reload's cost shows in steps
    )  # fmt: skip
    return Engine(profile, kv_events=events)


def run(e: Engine, rid: str, prompt: list[int]) -> tuple[Request, float, int]:
    """Run one request alone; its request, the seconds its steps took, prefill tokens."""
    request = Request(rid, prompt, 1)
    e.add(request)
    seconds = prefill = 0.0
    for _ in range(1000):
        if not e.has_work:
            break
        result = e.step()
        seconds += result.duration
        prefill += result.prefill_tokens
    return request, seconds, int(prefill)


A = list(range(100, 121))  # 21 tokens: 5 full blocks, 20 looked up (length - 1)
B = list(range(500, 529))  # 29 tokens: 8 blocks, evicts all of A's from the 8-block pool


@pytest.mark.parametrize(
    ("host", "disk", "found_in", "prefill"),
    [
        (0, 0, None, 21),  # no tier: A is recomputed
        (32, 0, kv_tiers.CPU, 1),  # the host tier holds A: its 5 blocks reload, 1 token runs
        (2, 32, kv_tiers.STORAGE, 1),  # A fell through the host tier to disk
    ],
)
def test_an_evicted_prefix_reloads_from_its_tier(host, disk, found_in, prefill) -> None:
    e = engine(host, disk)
    run(e, "a1", A)
    run(e, "b", B)
    assert not e.pool.cached.keys() & set(e.block_hashes(Request("x", A, 1), A[:20]))
    request, seconds, ran = run(e, "a2", A)
    assert ran == prefill
    if found_in is None:
        assert e.tiers is None and request.cached_tokens == 0
        return
    counters = e.tiers.counters
    assert counters.hits_blocks[found_in] == 5
    assert request.cached_tokens == 20 and e.external_hits == 20
    assert e.prefix_hits == 0  # the GPU's own counter: not its hit
    block_bytes = BLOCK * PER_TOKEN
    reload = 5 * block_bytes / (1e-3 * 1e9)
    if found_in == kv_tiers.STORAGE:
        reload += 5 * block_bytes / (1e-4 * 1e9)
    assert seconds >= reload  # the load is paid, in the admitting step
    assert counters.loaded_bytes[found_in] == 5 * block_bytes


def test_a_reload_costs_less_than_the_prefill_it_saves_with_real_links() -> None:
    """H100 profile, 16k-token history: PCIe reload vs recompute (the tier's premise)."""
    profile = get_profile("llama-3.1-8b-h100")
    tokens = 16_384
    reload = kv_tiers.transfer_seconds(tokens, profile.kv_bytes_per_token, profile.host_gbps)
    prefill = profile.prefill_token_s * tokens
    assert reload < prefill / 5


def test_host_tier_is_an_lru_that_spills_to_disk() -> None:
    events: list = []
    tiers = OffloadTiers(4096, host_blocks=2, disk_blocks=2, events=events)
    h = [bytes([i]) * 32 for i in range(5)]
    tiers.store(h[:3], None, list(range(12)), 4)  # the first falls to disk
    assert list(tiers.lru["CPU"]) == h[1:3] and list(tiers.lru["STORAGE"]) == h[:1]
    assert tiers.lookup(h) == ["STORAGE", "CPU", "CPU"]
    tiers.load(h[:1], ["STORAGE"])  # promoted through host memory: h[1] falls to disk
    assert tiers.tier_of(h[0]) == "CPU" and tiers.tier_of(h[1]) == "STORAGE"
    tiers.store(h[3:5], h[2], list(range(8)), 4)  # disk evicts its oldest
    assert sum(len(lru) for lru in tiers.lru.values()) == 4
    kinds = [(e["type"], e["medium"]) for e in events]
    assert ("BlockRemoved", "STORAGE") in kinds and ("BlockStored", "STORAGE") in kinds
    assert kinds[0] == ("BlockStored", "CPU")
    assert tiers.counters.stored_blocks == {"CPU": 6, "STORAGE": 4}  # h0 went down twice


def test_engine_announces_offloaded_blocks_with_their_medium() -> None:
    e = engine(host_blocks=32, events=True)
    run(e, "a1", A)
    run(e, "b", B)
    run(e, "a2", A)
    events = e.take_events()
    a = {kv_blocks.external(x) for x in e.block_hashes(Request("x", A, 1), A[:20])}
    cpu = {h for ev in events if ev["type"] == "BlockStored" and ev["medium"] == "CPU"
           for h in ev["block_hashes"]}  # fmt: skip
    gpu_removed = {h for ev in events if ev["type"] == "BlockRemoved" and ev["medium"] == "GPU"
                   for h in ev["block_hashes"]}  # fmt: skip
    assert a <= cpu and a <= gpu_removed
    last_gpu_store = [ev for ev in events if ev["type"] == "BlockStored" and ev["medium"] == "GPU"]
    assert a <= {h for ev in last_gpu_store for h in ev["block_hashes"]}  # reloaded: on GPU


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM's event classes are the reference"
)


@needs_vllm
@pytest.mark.parametrize("medium", ["CPU", "STORAGE"])
def test_tier_events_encode_byte_equal_to_vllms(medium, tmp_path_factory) -> None:
    import sys

    from kubellm.engine import launcher

    if launcher.torchcodec_broken():  # vLLM's CPU build imports it; the launcher's stand-in
        sys.path.insert(0, launcher.write_torchcodec_shim(tmp_path_factory.mktemp("shim")))
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    ours = [
        kv_blocks.block_stored([11, 12], 10, list(range(8)), 4, None, medium=medium),
        kv_blocks.block_stored([13], None, [], 0, medium=medium),  # a block moved down
        kv_blocks.block_removed([11], medium),
    ]
    theirs = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[11, 12], parent_block_hash=10, token_ids=list(range(8)),
                    block_size=4, lora_id=None, medium=medium, lora_name=None),
        BlockStored(block_hashes=[13], parent_block_hash=None, token_ids=[], block_size=0,
                    lora_id=None, medium=medium, lora_name=None),
        BlockRemoved(block_hashes=[11], medium=medium),
    ], data_parallel_rank=0)  # fmt: skip
    assert kv_blocks.encode_batch(1.5, ours) == msgspec.msgpack.Encoder().encode(theirs)


@needs_vllm
def test_offload_metric_names_are_vllms() -> None:
    """Each name is a string literal in the vLLM module that defines it (read as text:
    importing the connector's modules needs a GPU build's libraries)."""
    from pathlib import Path

    from kubellm.engine import sim_tiers

    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    where = {
        sim_tiers.LOAD_BYTES: "distributed/kv_transfer/kv_connector/v1/offloading/metrics.py",
        sim_tiers.STORE_BYTES: "distributed/kv_transfer/kv_connector/v1/offloading/metrics.py",
        sim_tiers.TIER_READ_BYTES: "v1/kv_offload/tiering/base.py",
        sim_tiers.TIER_WRITE_BYTES: "v1/kv_offload/tiering/base.py",
        sim_tiers.EXTERNAL_QUERIES: "v1/metrics/loggers.py",
        sim_tiers.EXTERNAL_HITS: "v1/metrics/loggers.py",
    }
    for name, path in where.items():
        assert f'"{name}"' in (root / path).read_text(), (name, path)


def test_simulator_exports_the_offload_counters() -> None:
    from kubellm.engine.sim_runtime import Simulator
    from kubellm.engine.sim_tokenizer import ApproxTokenizer
    from prometheus_client.parser import text_string_to_metric_families

    def samples(sim: Simulator) -> dict[tuple[str, str | None], float]:
        text = sim.render_metrics().decode()
        return {(s.name, s.labels.get("tier")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip

    plain = Simulator("m", engine(0).profile, 1.0, ApproxTokenizer())
    assert not any("offload" in name for name, _ in samples(plain))
    sim = Simulator("m", engine(2, 32).profile, 1.0, ApproxTokenizer())
    for rid, prompt in (("a1", A), ("b", B), ("a2", A)):
        run(sim.engine, rid, prompt)
    got = samples(sim)
    block_bytes = BLOCK * PER_TOKEN
    assert got[("vllm:external_prefix_cache_hits_total", None)] == 20
    assert got[("vllm:kv_offload_load_bytes_total", None)] == 5 * block_bytes
    assert got[("vllm:kv_offload_tiering_read_bytes_total", "fs")] > 0
    assert got[("vllm:kv_offload_store_bytes_total", None)] >= 13 * block_bytes


def test_kv_usage_stays_the_gpu_pools_with_a_tier() -> None:
    """The autoscaler scales on vllm:kv_cache_usage_perc: the GPU pool's occupancy, which a
    host tier full of blocks does not change (it holds a cache, not running requests)."""
    plain, tiered = engine(0), engine(host_blocks=32)
    for e in (plain, tiered):
        for rid, prompt in (("a1", A), ("b", B)):
            run(e, rid, prompt)
    assert tiered.tiers is not None and len(tiered.tiers.lru["CPU"]) > 8  # > the GPU pool
    assert tiered.kv_cache_usage() == plain.kv_cache_usage() == tiered.pool.usage()
    request = Request("c", A, 50)
    plain.add(request)
    plain.step()
    tiered.add(Request("c", A, 50))
    tiered.step()
    assert tiered.kv_cache_usage() == plain.kv_cache_usage() > 0
