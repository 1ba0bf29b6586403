"""The approximate prefix index with a replica's host tier (index/approx_tiers.py): chunks
sent stay on the GPU up to its pool, move down to the host tier when the GPU evicts them,
are forgotten past the host tier, move back up when sent again, and a restarted replica
holds nothing; the scorer counts a host chunk at the host tier's worth."""

from __future__ import annotations

import pytest
from kubellm.gateway.routing.index.approx_tiers import ChunkTiers
from kubellm.gateway.routing.index.kv_tiers import DEFAULT_VALUE
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.scorers.prefix import PrefixIndex, PrefixScorer

URL = "http://r0"
A = tuple(range(100, 104))  # a 4-chunk chain
B = tuple(range(200, 204))
C = tuple(range(300, 304))


def index_with(tiers: ChunkTiers | None, *sent: tuple[int, ...]) -> PrefixIndex:
    index = PrefixIndex(capacity=64)
    index.set_tiers(URL, tiers)
    for chain in sent:
        index.record(URL, chain)
    return index


# (case, tiers (GPU, host chunks), chains sent in order, chain looked up, (GPU, host))
CASES = [
    ("stored on the GPU", (8, 16), [A], A, (4, 0)),
    ("moved down a tier: the GPU evicted it, the host holds it", (4, 12), [A, B], A, (0, 4)),
    ("the newest stays on the GPU", (4, 12), [A, B], B, (4, 0)),
    ("removed: pushed past the host tier", (4, 8), [A, B, C], A, (0, 0)),
    ("the host tier still holds the next", (4, 8), [A, B, C], B, (0, 4)),
    ("sent again: reloaded into the GPU", (4, 12), [A, B, A], A, (4, 0)),
    ("a host tier no larger than the GPU keeps nothing below it", (4, 4), [A, B], A, (0, 0)),
    ("the GPU's run, then the host's", (4, 12), [A, B, A[:2]], A, (2, 2)),
    ("no tier: one LRU of the index's capacity", None, [A, B, C], A, (4, 0)),
]


@pytest.mark.parametrize(
    ("tiers", "sent", "chain", "expected"),
    [pytest.param(t, s, c, e, id=name) for name, t, s, c, e in CASES],
)
def test_tiers(
    tiers: tuple[int, int] | None,
    sent: list[tuple[int, ...]],
    chain: tuple[int, ...],
    expected: tuple[int, int],
) -> None:
    index = index_with(None if tiers is None else ChunkTiers(*tiers), *sent)
    assert index.matched_by_tier(URL, chain) == expected
    assert index.matched(URL, chain) == sum(expected)


def test_half_evicted_chain_is_scored_by_tier() -> None:
    """A's first two chunks were evicted from the GPU first (LRU order inside a chain is
    the order sent): the GPU's run is empty there, so only the host tier continues."""
    index = index_with(ChunkTiers(6, 12), A, B)
    gpu, host = index.matched_by_tier(URL, A)
    # A's oldest two chunks went down; the GPU keeps A[2:], B: vLLM's lookup starts at the
    # GPU, finds A[0] missing, and the host tier continues the whole chain (it holds a
    # copy of every GPU block)
    assert (gpu, host) == (0, 4)


def test_replica_restarted_holds_nothing_and_keeps_its_tiers() -> None:
    index = index_with(ChunkTiers(4, 12), A, B)
    index.forget(URL)
    assert index.matched_by_tier(URL, A) == (0, 0)
    assert index.matched_by_tier(URL, B) == (0, 0)
    index.record(URL, A)
    index.record(URL, B)
    assert index.matched_by_tier(URL, A) == (0, 4)


def test_tiers_learnt_after_sends_spill_at_once() -> None:
    index = index_with(None, A, B, C)
    index.set_tiers(URL, ChunkTiers(4, 8))
    assert [index.matched_by_tier(URL, x) for x in (A, B, C)] == [(0, 0), (0, 4), (4, 0)]


def test_tiers_dropped_keep_what_the_gpu_holds() -> None:
    index = index_with(ChunkTiers(4, 12), A, B)
    index.set_tiers(URL, None)
    assert index.matched_by_tier(URL, B) == (4, 0)
    assert index.matched_by_tier(URL, A) == (0, 0)


def test_from_tokens() -> None:
    # 256-character chunks at ~4 characters a token: 64 tokens a chunk
    assert ChunkTiers.from_tokens(64_000, 640_000, 256) == ChunkTiers(1000, 10_000)
    with pytest.raises(ValueError, match="positive GPU pool"):
        ChunkTiers.from_tokens(0, 100, 256)


def test_scorer_counts_a_host_chunk_at_its_worth() -> None:
    index = PrefixIndex(capacity=64)
    index.set_tiers("http://r0", ChunkTiers(4, 12))
    index.record("http://r0", A)
    index.record("http://r0", B)  # A moved down to the host tier on r0
    index.record("http://r1", A)  # A on r1's GPU
    request = RoutingRequest(model="m", chunk_hashes=A)
    scores = PrefixScorer(index).score(request, [Candidate("http://r0"), Candidate("http://r1")])
    assert scores == pytest.approx([DEFAULT_VALUE.weights["CPU"], 1.0])
    assert 0.5 < scores[0] < scores[1]


def test_the_router_models_the_tiers_its_discovery_reports() -> None:
    """status.capacity's kvTokensGPU / kvTokensHost (ModelTarget.kv_tier_tokens) reach the
    approximate index: with a GPU pool of 4 chunks, a prompt two prompts old is held in
    the host tier and scored there at its worth."""
    from kubellm.gateway.discovery.base import Endpoint, ModelTarget
    from kubellm.gateway.routing.replicas.load import LoadView
    from kubellm.gateway.routing.replicas.outliers import OutlierDetector
    from kubellm.gateway.routing.router import Router, routing_request

    router = Router(LoadView(), OutlierDetector(3, 5.0))
    chunk_tokens = 256 // 4
    target = ModelTarget(
        served_name="m", deployment="m", endpoints=(Endpoint(URL),),
        kv_tier_tokens=(4 * chunk_tokens, 12 * chunk_tokens),
    )  # fmt: skip
    prompts = [routing_request("m", {"prompt": c * 1024}, None) for c in "abc"]
    for request in prompts:
        router.order(target, request, router.candidates(target))
        router.routed(request, URL, [URL])
    index = router.index
    assert index.matched_by_tier(URL, prompts[0].chunk_hashes) == (0, 4)
    assert index.matched_by_tier(URL, prompts[2].chunk_hashes) == (4, 0)
    scored = PrefixScorer(index).score(prompts[0], [Candidate(URL)])
    assert scored == pytest.approx([DEFAULT_VALUE.weights["CPU"]])
