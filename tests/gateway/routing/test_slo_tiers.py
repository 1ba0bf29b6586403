"""slo-aware sees the KV offload tiers (issue 42): with spec.routing.prefixIndex precise,
its prediction counts a prefix the replica holds by the KV events' tiers (a host or disk
block at its worth, so the TTFT includes the reload), not by what this gateway sent there."""

from __future__ import annotations

import random

import pytest
from kubellm.gateway.discovery.base import Endpoint, ModelTarget
from kubellm.gateway.routing.index.kv_events import KVIndex
from kubellm.gateway.routing.index.kv_tiers import DEFAULT_VALUE
from kubellm.gateway.routing.index.precise_routing import PreciseRouting
from kubellm.gateway.routing.latency.model import Prior
from kubellm.gateway.routing.replicas.load import LoadView
from kubellm.gateway.routing.replicas.outliers import OutlierDetector
from kubellm.gateway.routing.router import Router
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest

from kubellm import api, kv_blocks

URLS = ("http://gpu", "http://host", "http://disk", "http://miss", "http://stale")
BLOCK = 16
CHAIN = list(range(1000, 1256))  # 256 blocks: 4,096 tokens
PROMPT = RoutingRequest(model="m", prompt_chars=4 * BLOCK * len(CHAIN), kv_hashes=tuple(CHAIN))


class _Fresh:
    """The events subscriber, as far as routing asks it: whose events are fresh."""

    def fresh(self, url: str) -> bool:
        return url != "http://stale"


def _precise() -> PreciseRouting:
    kv = KVIndex()
    gpu = kv_blocks.block_stored(CHAIN, None, [], BLOCK)
    host = kv_blocks.block_stored(CHAIN, None, [], 0, medium="CPU")
    disk = kv_blocks.block_stored(CHAIN, None, [], 0, medium="STORAGE")
    for url, events in (
        ("http://gpu", [gpu]),
        ("http://host", [host]),
        ("http://disk", [disk]),
        ("http://miss", []),
        ("http://stale", [gpu]),  # held, but its events are stale: not believed
    ):
        kv.apply(url, 0, [0.0, events, 0])
    return PreciseRouting(index=kv, subscriber=_Fresh())  # type: ignore[arg-type]


def _target(prefix_index: str = "precise") -> ModelTarget:
    return ModelTarget(
        served_name="m",
        deployment="m",
        endpoints=tuple(Endpoint(u) for u in URLS),
        routing=api.Routing(policy="slo-aware", prefixIndex=prefix_index),
        # a TTFT target the prefill dominates (the cost is the worst of TTFT and ITL over
        # their targets: at 1 s the idle replicas' ITL, 7 ms of 50, would tie them all)
        slo=api.SLO(ttftSeconds=0.1, itlSeconds=0.05),
    )


tokens = BLOCK * len(CHAIN)
weights = DEFAULT_VALUE.weights
# replica -> the prompt tokens counted as cached (a lower tier's block at its worth)
TABLE = {
    "http://gpu": tokens,
    "http://host": round(weights["CPU"] * tokens),
    "http://disk": round(weights["STORAGE"] * tokens),
    "http://miss": 0,
}


def test_the_prediction_counts_a_prefix_by_its_tier() -> None:
    router = Router(LoadView(), OutlierDetector(), random.Random(0), precise=_precise())
    predictions = router.predictions
    cached = predictions.tiered(_target(), PROMPT)
    assert cached == TABLE  # the stale replica is left to the approximate record
    candidates = [Candidate(url=u) for u in URLS]
    costs = predictions.costs(PROMPT, candidates, 1.0, 0.05, cached)
    ttft = {url: t for url, (_, t, _) in costs.items()}
    prior = Prior()
    for url, held in TABLE.items():  # the prefill left, reloads included, at the prior
        assert ttft[url] - ttft["http://gpu"] == pytest.approx(
            (tokens - held) * prior.prefill_token_s, abs=2 * prior.prefill_token_s
        )
    assert ttft["http://gpu"] < ttft["http://host"] < ttft["http://disk"] < ttft["http://miss"]
    assert ttft["http://stale"] == ttft["http://miss"]  # nothing sent there by this gateway


@pytest.mark.parametrize(
    ("prefix_index", "first"), [("precise", "http://gpu"), ("approximate", None)]
)
def test_slo_aware_orders_replicas_by_the_tiered_prediction(prefix_index, first) -> None:
    """Precise: the GPU holder, then the host tier, then the disk tier before a miss. The
    approximate index knows nothing of the events: no tiered match at all."""
    router = Router(LoadView(), OutlierDetector(), random.Random(0), precise=_precise())
    target = _target(prefix_index)
    candidates = [Candidate(url=u) for u in URLS if u != "http://stale"]
    if first is None:
        assert router.predictions.tiered(target, PROMPT) is None
        return
    order = [c.url for c in router.order(target, PROMPT, candidates)]
    assert order == ["http://gpu", "http://host", "http://disk", "http://miss"]


def test_the_attempt_is_learnt_with_the_tiered_match() -> None:
    """The SLO gate records the attempt with the same cached tokens it predicted with, so
    the model learns from what it predicted (not from a miss it never predicted)."""
    from kubellm.gateway.routing.gates.slo import SloGate

    router = Router(LoadView(), OutlierDetector(), random.Random(0), precise=_precise())
    gate = SloGate(router.predictions, lambda t: ("m", "", ""))

    class Ticket:
        routing, target, order, dispatch = PROMPT, _target(), [], None

    ticket = Ticket()
    gate.sent(ticket, "http://host")  # type: ignore[arg-type]
    assert ticket.dispatch[1].cached_tokens == TABLE["http://host"]
