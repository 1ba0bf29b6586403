"""The simulated engine's model of one vLLM replica, driven step by step."""

from __future__ import annotations

import pytest
from kubellm.engine import sim_profiles as profiles
from kubellm.engine.sim_core import RUNNING, WAITING, BlockPool, Engine, Request, block_hashes

SMALL = profiles.Profile(
    name="test", block_size=4, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=16,
    max_model_len=64, step_base_s=0.01, prefill_token_s=0.001, decode_token_s=0.002,
)  # fmt: skip


def run_to_completion(engine: Engine, max_steps: int = 1000) -> int:
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < max_steps, "engine made no progress"
    return steps


def test_block_hashes_chain_so_equal_blocks_after_different_prefixes_differ() -> None:
    a = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = block_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert len(a) == 2 and a[1] != b[1]
    assert block_hashes([1, 2, 3, 4, 9, 9, 9, 9, 7], 4) == a  # partial block not hashed


def test_pool_evicts_least_recently_freed_block_first() -> None:
    pool = BlockPool(3)
    first, second = pool.allocate(), pool.allocate()
    pool.cache(first, 111)
    pool.cache(second, 222)
    pool.release([first, second])  # tail first: `second` is freed before `first`
    assert pool.usage() == 0.0  # cached but idle blocks count as free
    pool.allocate()  # the never-used third block
    pool.allocate()  # evicts `second`
    assert 222 not in pool.cached and 111 in pool.cached


def test_a_request_prefills_then_decodes_one_token_per_step() -> None:
    engine = Engine(SMALL)
    engine.add(Request("r", list(range(10)), max_tokens=3))
    first = engine.step()
    assert first.prefill_tokens == 10 and len(first.tokens) == 1
    second = engine.step()
    assert second.decode_tokens == 1 and second.prefill_tokens == 0
    assert second.duration == pytest.approx(SMALL.step_seconds(0, 1))
    engine.step()
    assert not engine.has_work and engine.kv_cache_usage() == 0.0


def test_long_prompts_are_chunked_by_the_step_budget() -> None:
    engine = Engine(SMALL)
    engine.add(Request("r", list(range(40)), max_tokens=1))
    chunks = [engine.step().prefill_tokens for _ in range(3)]
    assert chunks == [16, 16, 8]
    assert not engine.has_work


def test_running_requests_are_served_before_waiting_ones_and_seats_are_capped() -> None:
    engine = Engine(SMALL)
    for index in range(6):
        engine.add(Request(f"r{index}", [index] * 2, max_tokens=5))
    engine.step()
    assert len(engine.running) == SMALL.max_num_seqs
    assert len(engine.waiting) == 2
    result = engine.step()
    assert result.decode_tokens == 4 and result.prefill_tokens == 0


def test_shared_prefix_is_a_hit_counted_like_vllm() -> None:
    engine = Engine(SMALL)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    engine.add(Request("a", prompt, max_tokens=1))
    run_to_completion(engine)
    assert (engine.prefix_queries, engine.prefix_hits) == (10, 0)
    engine.add(Request("b", [*prompt[:8], 77, 78], max_tokens=1))
    run_to_completion(engine)
    assert (engine.prefix_queries, engine.prefix_hits) == (20, 8)


def test_a_fully_cached_block_aligned_prompt_recomputes_its_last_block() -> None:
    engine = Engine(SMALL)
    for name in ("a", "b"):
        engine.add(Request(name, list(range(8)), max_tokens=1))
        run_to_completion(engine)
    assert engine.prefix_hits == 4  # capped at prompt length - 1 tokens


def test_no_prefix_caching_means_no_queries_and_no_hits() -> None:
    engine = Engine(SMALL.with_overrides(prefix_caching=False))
    for name in ("a", "b"):
        engine.add(Request(name, list(range(10)), max_tokens=1))
        run_to_completion(engine)
    assert (engine.prefix_queries, engine.prefix_hits) == (0, 0)


def test_kv_exhaustion_preempts_the_newest_request_and_it_still_finishes() -> None:
    tight = SMALL.with_overrides(num_blocks=6, max_num_batched_tokens=64)
    engine = Engine(tight)
    engine.add(Request("old", [1] * 8, max_tokens=8))
    engine.add(Request("new", [2] * 8, max_tokens=8))
    engine.step()  # both admitted: 2 + 2 blocks
    states = []
    for _ in range(20):
        engine.step()
        states.append({r.request_id: r.status for r in [*engine.running, *engine.waiting]})
        if engine.preemptions:
            break
    assert engine.preemptions >= 1
    assert states[-1].get("new") == WAITING and states[-1].get("old") == RUNNING
    run_to_completion(engine)
    assert engine.prefix_queries == 16  # the recomputation is not counted again


def test_usage_tracks_held_blocks() -> None:
    engine = Engine(SMALL)
    engine.add(Request("r", list(range(12)), max_tokens=4))
    engine.step()  # 12 prompt tokens computed: 3 blocks
    assert engine.kv_cache_usage() == pytest.approx(3 / SMALL.num_blocks)
    engine.step()  # the 13th token needs a 4th block
    assert engine.kv_cache_usage() == pytest.approx(4 / SMALL.num_blocks)


def test_requests_that_cannot_fit_are_refused_with_a_reason() -> None:
    engine = Engine(SMALL)
    assert "maximum context length is 64" in (engine.validate(60, 10) or "")
    assert engine.validate(10, 10) is None


def test_the_8b_profile_is_derived_from_capacity_arithmetic() -> None:
    profile = profiles.get("llama-3.1-8b-h100")
    kv_tokens = profile.num_blocks * profile.block_size
    # 57 GiB of KV at 128 KiB per token: about 467k tokens, ~114 requests of 4,096 tokens
    assert 440_000 < kv_tokens < 480_000
    assert 0.005 < profile.step_seconds(0, 1) < 0.012  # one decode step of an 8B model


def test_unknown_profile_names_the_option_and_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"--profile 'nope'.*llama-3.1-8b-h100"):
        profiles.get("nope")


def test_a_request_admitted_in_the_same_step_hits_blocks_allocated_just_before() -> None:
    engine = Engine(SMALL.with_overrides(max_num_batched_tokens=64))
    engine.add(Request("a", list(range(10)), max_tokens=1))
    engine.add(Request("b", list(range(10)), max_tokens=1))
    engine.step()
    assert engine.prefix_hits == 8  # as vLLM: blocks are cached when allocated
