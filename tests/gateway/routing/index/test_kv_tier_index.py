"""The precise index keeps each block's tier per replica from the KV events (stored,
moved down a tier, removed, a replica restarted), and a prefix's worth by tier comes from
the reload and prefill costs."""

from __future__ import annotations

import pytest
from kubellm.gateway.routing.index.kv_events import KVIndex
from kubellm.gateway.routing.index.kv_tiers import DEFAULT_VALUE, TierValue
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.scorers.precise import PrecisePrefixScorer
from kubellm.gateway.routing.scorers.prefix import PrefixIndex

from kubellm import kv_blocks

A, B = "http://a", "http://b"
CHAIN = [11, 12, 13, 14]


def stored(hashes, medium="GPU"):
    return kv_blocks.block_stored(hashes, None, [], 16 if medium == "GPU" else 0, medium=medium)


def removed(hashes, medium="GPU"):
    return kv_blocks.block_removed(hashes, medium)


# (events for replica A in order, (GPU, host, disk) blocks of CHAIN matched on A)
TABLE = {
    "GPU only": ([stored(CHAIN)], (4, 0, 0)),
    "written through to host": ([stored(CHAIN), stored(CHAIN, "CPU")], (4, 0, 0)),
    "evicted from the GPU, kept on host": (
        [stored(CHAIN), stored(CHAIN, "CPU"), removed(CHAIN[2:])], (2, 2, 0)),
    "all on host": ([stored(CHAIN, "CPU")], (0, 4, 0)),
    "moved down to disk": (
        [stored(CHAIN, "CPU"), removed(CHAIN[1:], "CPU"), stored(CHAIN[1:], "STORAGE")],
        (0, 1, 3)),
    "removed from host, nowhere else": (
        [stored(CHAIN, "CPU"), removed(CHAIN[1:2], "CPU")], (0, 1, 0)),
    "a GPU removal leaves the host copy": (
        [stored(CHAIN[:2]), stored(CHAIN, "CPU"), removed(CHAIN[:2])], (0, 4, 0)),
    "the GPU's reset leaves the host copy": (
        [stored(CHAIN), stored(CHAIN, "CPU"), kv_blocks.all_blocks_cleared()], (0, 4, 0)),
    "a chain broken on every tier stops": (
        [stored(CHAIN[:1]), stored(CHAIN[2:], "CPU")], (1, 0, 0)),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TABLE))
def test_index_keeps_each_blocks_tier(case) -> None:
    events, expected = TABLE[case]
    kv = KVIndex()
    for seq, event in enumerate(events):
        kv.apply(A, seq, [0.0, [event], 0])
    kv.apply(B, 0, [0.0, [stored(CHAIN, "CPU")], 0])
    assert kv.matched_by_tier(A, CHAIN) == expected
    assert kv.matched(A, CHAIN) == expected[0]  # the GPU's own figure is unchanged
    assert kv.matched_by_tier(B, CHAIN) == (0, 4, 0)  # the other replica's, untouched


def test_a_restarted_or_departed_replica_loses_its_offloaded_blocks() -> None:
    kv = KVIndex()
    kv.apply(A, 5, [0.0, [stored(CHAIN, "CPU")], 0])
    kv.apply(B, 0, [0.0, [stored(CHAIN, "CPU")], 0])
    applied = kv.apply(A, 0, [0.0, [], 0])  # its numbering went back: it restarted
    assert applied.restarted and kv.matched_by_tier(A, CHAIN) == (0, 0, 0)
    kv.forget(B)
    assert kv.matched_by_tier(B, CHAIN) == (0, 0, 0)
    kv.apply(B, 0, [0.0, [stored(CHAIN[:1])], 0])  # a new replica in the freed slot
    assert kv.matched_by_tier(B, CHAIN) == (1, 0, 0)


def test_lower_tier_entries_are_bounded_per_replica() -> None:
    kv = KVIndex(per_replica=3)
    kv.apply(
        A,
        0,
        [
            0.0,
            [stored(CHAIN, "CPU"), {"type": "BlockStored", "block_hashes": ["x"], "medium": "CPU"}],
            0,
        ],
    )
    assert kv.lower.entries(0) == 3 and kv.lower.dropped_total == 0  # sliced at the bound


@pytest.mark.parametrize(
    ("prefill_s", "per_token", "cpu", "disk"),
    [
        (32e-6, 131_072, 0.918, 0.235),  # 8B on an H100: 2.6 us vs 32 us per token
        (32e-6 * 8.8, 327_680, 0.977, 0.783),  # 70B: 8.8x the FLOPs, 2.5x the KV bytes
        (2e-6, 131_072, 0.0, 0.0),  # a reload dearer than the prefill is worth nothing
    ],
)
def test_a_tiers_value_is_the_prefill_its_reload_saves(prefill_s, per_token, cpu, disk) -> None:
    value = TierValue.from_physics(prefill_s, per_token)
    assert value.weights["GPU"] == 1.0
    assert value.weights["CPU"] == pytest.approx(cpu, abs=0.002)
    assert value.weights["STORAGE"] == pytest.approx(disk, abs=0.002)


def test_fixed_weights_are_checked() -> None:
    assert TierValue.fixed().weights == {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.25}
    with pytest.raises(ValueError, match="tiers are GPU, CPU, STORAGE"):
        TierValue.fixed({"HBM": 1.0})
    with pytest.raises(ValueError, match="weights lie in"):
        TierValue.fixed({"CPU": 1.5})


def test_precise_scorer_ranks_gpu_then_host_then_a_miss() -> None:
    kv = KVIndex()
    kv.apply(A, 0, [0.0, [stored(CHAIN)], 0])
    kv.apply(B, 0, [0.0, [stored(CHAIN, "CPU")], 0])
    c = "http://c"
    kv.apply(c, 0, [0.0, [], 0])
    request = RoutingRequest(model="m", prompt_chars=0, chunk_hashes=(), kv_hashes=tuple(CHAIN))
    candidates = [Candidate(url=u) for u in (A, B, c)]
    scorer = PrecisePrefixScorer(kv, lambda url: True, PrefixIndex(), recent_s=0)
    gpu, host, miss = scorer.score(request, candidates)
    assert gpu == 1.0 and miss == 0.0
    assert host == pytest.approx(DEFAULT_VALUE.weights["CPU"])
    peers = PrecisePrefixScorer(kv, lambda url: True, PrefixIndex(), recent_s=0,
                                tier_value=TierValue.fixed())  # fmt: skip
    assert peers.score(request, candidates)[1] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("gpu", "host", "disk"), [(0, 0, 0), (100, 0, 0), (0, 100, 0), (40, 60, 0), (10, 20, 30)]
)
def test_the_latency_model_charges_a_reload_not_a_prefill(gpu, host, disk) -> None:
    """TTFT with a prefix matched by tier = TTFT with it all on the GPU + its reloads."""
    from kubellm.gateway.routing.index.kv_tiers import cached_tokens
    from kubellm.gateway.routing.latency.model import Dispatch, Prior

    prior, block, per_token = Prior(), 16, 131_072
    value = TierValue.from_physics(prior.prefill_token_s, per_token)
    prompt = 4096
    on_gpu = Dispatch(prompt, (gpu + host + disk) * block)
    tiered = Dispatch(prompt, cached_tokens(value, gpu, host, disk, block))
    reload = (host + disk) * block * per_token / 50e9 + disk * block * per_token / 6e9
    assert prior.ttft(tiered) - prior.ttft(on_gpu) == pytest.approx(
        reload, abs=prior.prefill_token_s
    )
