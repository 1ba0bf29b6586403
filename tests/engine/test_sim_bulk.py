"""`BatchEngine` (decode steps in bulk, for the fleet simulation) against `Engine`, step by step.

Both engines get the same requests at the same steps; after every step they must agree on
everything a caller can see: the step's duration and token counts, the first tokens, the
requests finished (in order), the waiting and running lists, KV usage and preemptions; at
the end every request's output tokens.
"""

from __future__ import annotations

import random

import pytest
from kubellm.engine import sim_profiles as profiles
from kubellm.engine.sim_core import BatchEngine, Engine, Request

ROOMY = profiles.Profile(
    name="roomy", block_size=4, num_blocks=400, max_num_seqs=8, max_num_batched_tokens=32,
    max_model_len=256, step_base_s=0.01, prefill_token_s=0.001, decode_token_s=0.002,
    prefix_caching=False,
)  # fmt: skip
# a pool that runs out: preemptions, recomputed prompts, Engine's own step for those
TIGHT = profiles.Profile(
    name="tight", block_size=4, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=24,
    max_model_len=128, step_base_s=0.01, prefill_token_s=0.001, decode_token_s=0.002,
    prefix_caching=False,
)  # fmt: skip


def view(engine: Engine) -> tuple:
    return (
        [r.request_id for r in engine.waiting],
        [r.request_id for r in engine.running],
        engine.kv_cache_usage(),
        engine.pool.num_free,
        engine.preemptions,
        engine.has_work,
    )


def side_by_side(
    profile: profiles.Profile, seed: int, steps: int = 3000, longest: int = 61
) -> tuple[int, int]:
    """Random arrivals between steps; returns (bulk steps seen, preemptions)."""
    rng = random.Random(seed)
    plain, bulk = Engine(profile), BatchEngine(profile)
    assert bulk.bulk
    requests: dict[str, tuple[Request, Request]] = {}
    in_bulk = 0
    for step in range(steps):
        for _ in range(rng.choice((0, 0, 0, 1, 1, 2, 4))):
            name = f"r{len(requests)}"
            prompt = [len(requests) + 2] + [1] * rng.randint(0, longest - 1)
            output = rng.randint(1, 40)
            pair = Request(name, list(prompt), output), Request(name, list(prompt), output)
            requests[name] = pair
            plain.add(pair[0])
            bulk.add(pair[1])
        if plain.running and rng.random() < 0.01:  # a client goes away
            index = rng.randrange(len(plain.running))
            name = plain.running[index].request_id
            plain.abort(requests[name][0])
            bulk.abort(requests[name][1])
        a, b = plain.step(), bulk.step()
        assert (a.duration, a.prefill_tokens, a.decode_tokens) == (
            b.duration,
            b.prefill_tokens,
            b.decode_tokens,
        ), f"step {step}"
        first_a = [(r.request_id, t) for r, t in a.tokens if len(r.output) == 1]
        first_b = [(r.request_id, t) for r, t in b.tokens if len(r.output) == 1]
        assert first_a == first_b, f"step {step}"
        assert [r.request_id for r in a.finished] == [r.request_id for r in b.finished]
        for r in b.finished:
            assert r.output == requests[r.request_id][0].output, f"step {step}: {r.request_id}"
        assert view(plain) == view(bulk), f"step {step}"
        in_bulk += b.decode_tokens > 0 and not b.tokens
    while plain.has_work or bulk.has_work:
        a, b = plain.step(), bulk.step()
        assert (a.duration, [r.request_id for r in a.finished]) == (
            b.duration,
            [r.request_id for r in b.finished],
        )
    for one, other in requests.values():
        assert (one.output, one.status, one.preemptions) == (
            other.output,
            other.status,
            other.preemptions,
        )
    return in_bulk, plain.preemptions


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bulk_decode_agrees_with_the_engine_step_by_step(seed: int) -> None:
    in_bulk, _ = side_by_side(ROOMY, seed)
    assert in_bulk > 100  # most steps were decode-only steps taken in bulk


@pytest.mark.parametrize("seed", [0, 1])
def test_bulk_decode_agrees_through_preemptions(seed: int) -> None:
    _, preemptions = side_by_side(TIGHT, seed)
    assert preemptions > 0  # the pool ran out: Engine's own step took those


def test_bulk_decode_agrees_without_chunked_prefill() -> None:
    # every prompt fits one step's budget (a longer one would never be scheduled)
    side_by_side(ROOMY.with_overrides(chunked_prefill=False), 3, steps=1500, longest=30)


def test_a_decode_step_in_bulk_lists_no_tokens_and_sync_brings_fields_up_to_date() -> None:
    engine = BatchEngine(ROOMY)
    requests = [Request(f"r{i}", [i + 2, 1, 1], max_tokens=10) for i in range(3)]
    for request in requests:
        engine.add(request)
    first = engine.step()
    assert len(first.tokens) == 3  # first tokens are listed
    second = engine.step()
    assert second.decode_tokens == 3 and second.tokens == [] and not second.idle
    assert all(len(r.output) == 1 for r in requests)  # stale until sync
    engine.sync()
    reference = Engine(ROOMY)
    copies = [Request(r.request_id, [i + 2, 1, 1], max_tokens=10) for i, r in enumerate(requests)]
    for request in copies:
        reference.add(request)
    reference.step()
    reference.step()
    assert [r.output for r in requests] == [r.output for r in copies]
    assert [r.computed for r in requests] == [r.computed for r in copies]


@pytest.mark.parametrize(
    "changes",
    [
        {"prefix_caching": True},
        {"max_loras": 2},
        {"max_num_seqs": 64, "max_num_batched_tokens": 32},
    ],
)
def test_no_bulk_where_per_token_state_is_observable(changes: dict) -> None:
    engine = BatchEngine(ROOMY.with_overrides(**changes))
    assert not engine.bulk
    engine.add(Request("r", [2, 1, 1], max_tokens=3))
    engine.step()
    assert len(engine.step().tokens) == 1  # Engine's own step: every token listed
