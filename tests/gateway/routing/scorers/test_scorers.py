"""The pure routing pieces: prompt hashing, scorers, the load bound, the picker."""

from __future__ import annotations

import math
import random
import tracemalloc

import pytest
from kubellm.gateway.discovery.base import FallbackTarget, ModelTarget
from kubellm.gateway.routing.admission import (
    CompletionRate,
    Route,
    Thresholds,
    decide,
    predicted_wait,
    saturated,
)
from kubellm.gateway.routing.profiles import Profiles, Shared
from kubellm.gateway.routing.router import routing_request
from kubellm.gateway.routing.scorers import prefix
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.scorers.bounded_load import (
    capacity,
    within_bound,
    within_bound_or_holding,
)
from kubellm.gateway.routing.scorers.consistent_hash import ConsistentHashScorer, rendezvous_weight
from kubellm.gateway.routing.scorers.session import SessionTable

from kubellm.api import Routing


def test_chat_rendering_is_prefix_preserving_and_canonical():
    turn1 = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
    one, two = prefix.prompt_text({"messages": turn1}), prefix.prompt_text({"messages": turn2})
    assert two.startswith(one)
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}
    ]
    assert prefix.prompt_text({"messages": parts}) == prefix.prompt_text(
        {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert prefix.prompt_text({"prompt": "abc"}) == "abc"
    assert prefix.prompt_text({"prompt": [[1, 2, 3]]}) == "[1, 2, 3]"


def test_chunk_hashes_form_a_chain():
    base = "a" * 256 * 3
    hashes = prefix.chunk_hashes(base)
    assert len(hashes) == 3
    assert prefix.chunk_hashes(base + "b" * 300)[:3] == hashes  # shared prefix, shared hashes
    changed = "z" + base[1:]
    assert not set(prefix.chunk_hashes(changed)) & set(hashes)  # a change early changes all
    assert prefix.chunk_hashes("short") == ()
    assert len(prefix.chunk_hashes("x" * 256 * 1000)) == prefix.MAX_CHUNKS


def test_prefix_index_matches_longest_chain_and_stays_bounded():
    index = prefix.PrefixIndex(capacity=5)
    chain = prefix.chunk_hashes("q" * 256 * 4)
    index.record("a", chain[:2])
    assert index.matched("a", chain) == 2
    assert index.matched("b", chain) == 0
    index.record("a", prefix.chunk_hashes("w" * 256 * 4))
    assert index.size("a") == 5  # LRU evicted the oldest entry
    assert index.matched("a", chain) == 0  # the chain's first link was evicted


def test_consistent_hash_is_stable_and_spreads():
    scorer = ConsistentHashScorer()
    candidates = [Candidate(f"http://10.0.0.{i}:8000") for i in range(4)]
    homes = []
    for k in range(200):
        request = RoutingRequest("m", affinity_key=k * 7919)
        scores = scorer.score(request, candidates)
        assert sorted(scores) == [0, 0, 0, 1]
        assert scorer.score(request, list(reversed(candidates)))[::-1] == scores
        homes.append(scores.index(1.0))
    counts = [homes.count(i) for i in range(4)]
    assert min(counts) > 20  # roughly even: 50 each on average


def test_removing_an_endpoint_only_moves_its_own_prefixes():
    scorer = ConsistentHashScorer()
    urls = [f"http://10.0.0.{i}:8000" for i in range(4)]

    def home(key: int, among: list[str]) -> str:
        scores = scorer.score(RoutingRequest("m", affinity_key=key), [Candidate(u) for u in among])
        return among[scores.index(1.0)]

    for key in range(100):
        before = home(key, urls)
        if before != urls[0]:
            assert home(key, urls[1:]) == before


@pytest.mark.parametrize(
    ("loads", "bound", "kept"),
    [
        ([0, 0, 0, 0], 1.25, [0, 1, 2, 3]),
        ([1, 0, 0, 0], 1.25, [1, 2, 3]),  # cap = ceil(1.25 * 2 / 4) = 1
        ([5, 5, 5, 5], 1.25, [0, 1, 2, 3]),  # cap = ceil(26.25 / 4) = 7
        ([9, 3, 3, 3], 1.25, [1, 2, 3]),  # cap = ceil(23.75 / 4) = 6
        ([9, 3, 3, 3], 3.0, [0, 1, 2, 3]),
    ],
)
def test_bounded_load_filter(loads, bound, kept):
    candidates = [Candidate(str(i), load=v) for i, v in enumerate(loads)]
    assert [c.url for c in within_bound(candidates, bound)] == [str(i) for i in kept]
    assert capacity(loads, bound) >= 1


def test_bounded_load_never_empties_the_set():
    candidates = [Candidate("a", load=3.5), Candidate("b", load=3.2)]
    assert [c.url for c in within_bound(candidates, 1.0)] == ["b"]


def test_the_bound_widens_for_prefix_holders_only_and_only_by_the_slack():
    """loads 5,1,1,1: total 8, so cap = ceil(1.25 * 9 / 4) = 3; with slack 2 the holders'
    cap is ceil(2.5 * 9 / 4) = 6. The busy holder stays in; the busy non-holder does not."""
    loads = {"a": 5, "b": 1, "c": 1, "d": 1}
    candidates = [Candidate(u, load=v) for u, v in loads.items()]
    keep = within_bound_or_holding({"a"}, 2.0)
    assert [c.url for c in keep(candidates, 1.25)] == ["a", "b", "c", "d"]
    assert [c.url for c in within_bound_or_holding({"b"}, 2.0)(candidates, 1.25)] == [
        "b",
        "c",
        "d",
    ]
    # a at 7: total 10, widened cap ceil(2.5 * 11 / 4) = 7, and 7 + 1 > 7: out
    heavier = [Candidate(u, load={"a": 7}.get(u, 1)) for u in loads]
    assert [c.url for c in keep(heavier, 1.25)] == ["b", "c", "d"]
    # slack 1 is the plain bound
    assert within_bound_or_holding({"a"}, 1.0)(candidates, 1.25) == within_bound(candidates, 1.25)


class _Declared:
    """A declared profile (`routing/profiles.py`), bound per request as the router binds it
    (the cold-prompt choice off)."""

    def __init__(self, name: str, index: prefix.PrefixIndex | None = None) -> None:
        self.name = name
        shared = Shared(index or prefix.PrefixIndex(), SessionTable())
        self.profiles = Profiles(shared, cold=lambda request: False)


def _pick(
    profile: _Declared,
    request: RoutingRequest,
    candidates: list[Candidate],
    load_bound: float,
    rng: random.Random | None = None,
) -> list[Candidate]:
    target = ModelTarget("m", "m", routing=Routing(load_bound=load_bound))
    return profile.profiles.order(target, request, candidates, rng or random.Random(), profile.name)


def test_prefix_aware_prefers_home_until_it_is_over_the_bound():
    profile = _Declared("prefix-aware")
    request = routing_request("m", {"messages": [{"role": "user", "content": "p" * 600}]}, None)
    idle = [Candidate(f"u{i}") for i in range(4)]
    home = _pick(profile, request, idle, 1.25, random.Random(1))[0].url
    assert all(
        _pick(profile, request, idle, 1.25, random.Random(s))[0].url == home for s in range(5)
    )
    busy = [Candidate(c.url, load=4 if c.url == home else 1) for c in idle]
    assert _pick(profile, request, busy, 1.25, random.Random(0))[0].url != home
    # the filtered-out home is still offered last, for retries
    assert {c.url for c in _pick(profile, request, busy, 1.25)} == {c.url for c in idle}


def _rendezvous_order(request: RoutingRequest, urls: list[str]) -> list[str]:
    key = request.affinity_key
    assert key is not None
    return sorted(urls, key=lambda u: rendezvous_weight(key, u), reverse=True)


def test_cold_prompt_goes_home_despite_lighter_replicas_and_spills_in_rendezvous_order():
    """Where a new prefix starts depends on the prompt and the bound, not on load ranks."""
    index = prefix.PrefixIndex()
    profile = _Declared("prefix-aware", index)
    system = {"role": "system", "content": "tenant policy text " * 40}
    first = routing_request("m", {"messages": [system, {"role": "user", "content": "a"}]}, None)
    later = routing_request("m", {"messages": [system, {"role": "user", "content": "b"}]}, None)
    urls = [f"http://e{i}" for i in range(4)]
    home, second, third, _ = _rendezvous_order(first, urls)
    # the home busier than every other replica but within the bound (cap 4): still home
    lighter = [Candidate(u, load={home: 3}.get(u, 2)) for u in urls]
    assert _pick(profile, first, lighter, 1.25)[0].url == home
    # the home past the bound (cap 3): the next replica in rendezvous order, though busier
    over = [Candidate(u, load={home: 5, second: 1}.get(u, 0)) for u in urls]
    assert _pick(profile, first, over, 1.25)[0].url == second
    both_over = [Candidate(u, load={home: 5, second: 5}.get(u, 1)) for u in urls]  # cap 5
    assert _pick(profile, first, both_over, 1.25)[0].url == third
    # once the prefix is held somewhere, a new question on it goes there
    index.record(second, first.chunk_hashes)
    idle = [Candidate(u) for u in urls]
    assert _pick(profile, later, idle, 1.25)[0].url == second
    # and the bounded-load guard still moves it off an overloaded holder (past the
    # holders' bound: HOLDER_SLACK x loadBound, ceil(2.5 x 12 / 4) = 8)
    hot = [Candidate(u, load=8 if u == second else 1) for u in urls]
    assert _pick(profile, later, hot, 1.25)[0].url != second


def test_least_load_picks_the_emptiest_engine():
    profile = _Declared("least-load")
    candidates = [
        Candidate("a", load=3, in_flight=3, waiting=2, kv_usage=0.7),
        Candidate("b", load=1, in_flight=1, waiting=0, kv_usage=0.2),
        Candidate("c", load=2, in_flight=2, waiting=None, kv_usage=None),
    ]
    assert _pick(profile, RoutingRequest("m"), candidates, 1.25)[0].url == "b"


def test_two_routers_with_different_histories_and_load_views_agree():
    """Several gateway replicas: each sees its own in-flight counts and has routed other
    prompts, yet both send each new prefix to the same replica."""
    index_a, index_b = prefix.PrefixIndex(), prefix.PrefixIndex()
    a = _Declared("prefix-aware", index_a)
    b = _Declared("prefix-aware", index_b)
    urls = [f"http://e{i}" for i in range(4)]
    for k in range(30):  # only gateway a has seen these
        other = routing_request(
            "m", {"messages": [{"role": "user", "content": f"o{k} " * 99}]}, None
        )
        index_a.record(urls[k % 4], other.chunk_hashes)

    # the same engines seen at different moments: loads and queues far apart (a scrape
    # apart), all within the bound (cap 8)
    def view(loads: tuple[int, ...], waiting: tuple[int, ...]) -> list[Candidate]:
        return [
            Candidate(u, load=n, in_flight=n, waiting=w)
            for u, n, w in zip(urls, loads, waiting, strict=True)
        ]

    view_a = view((5, 7, 5, 7), (0, 3, 0, 3))
    view_b = view((7, 5, 7, 5), (3, 0, 3, 0))
    for k in range(50):
        body = {"messages": [{"role": "system", "content": f"tenant {k} " * 80}]}
        request = routing_request("m", body, None)
        assert _pick(a, request, view_a, 1.25)[0].url == _pick(b, request, view_b, 1.25)[0].url


@pytest.mark.parametrize(
    ("ready", "open_", "fallback", "fb_busy", "may_wait", "route", "reason"),
    [
        (2, 1, None, 0, True, Route.REPLICA, "ready"),
        (2, 0, "both", 0, True, Route.FALLBACK, "saturated"),
        (0, 0, "both", 0, True, Route.FALLBACK, "no-ready-replicas"),
        (2, 0, "both", 4, True, Route.QUEUE, "saturated"),  # fallback at its cap
        (2, 0, "zero-only", 0, True, Route.QUEUE, "saturated"),  # trigger not enabled
        (2, 0, None, 0, True, Route.QUEUE, "saturated"),
        (2, 0, None, 0, False, Route.REJECT, "saturated"),
        (0, 0, None, 0, False, Route.REJECT, "no-ready-replicas"),
    ],
)
def test_admission_decision(ready, open_, fallback, fb_busy, may_wait, route, reason):
    triggers = {"both": ("saturated", "no-ready-replicas"), "zero-only": ("no-ready-replicas",)}
    target = (
        FallbackTarget("http://x/v1", max_concurrency=4, triggers=triggers[fallback])
        if fallback
        else None
    )
    decision = decide(ready, open_, target, fb_busy, may_wait)
    assert (decision.route, decision.reason) == (route, reason)


@pytest.mark.parametrize(
    ("ready", "fallback", "wait", "budget", "may_wait", "route", "reason"),
    [
        (2, True, 0.2, 0.5, True, Route.QUEUE, "short-wait"),  # a slot frees in time
        (2, True, 0.8, 0.5, True, Route.FALLBACK, "saturated"),  # it would break the TTFT
        (2, True, math.inf, 0.5, True, Route.FALLBACK, "saturated"),  # nothing finishing
        (2, True, 0.2, 0.5, False, Route.FALLBACK, "saturated"),  # queue full
        (2, False, 0.8, 0.5, True, Route.QUEUE, "saturated"),  # no fallback: wait, as before
        (0, True, 0.0, 0.5, True, Route.FALLBACK, "no-ready-replicas"),  # nothing to wait on
    ],
)
def test_admission_weighs_predicted_wait_against_the_budget(
    ready, fallback, wait, budget, may_wait, route, reason
):
    target = FallbackTarget("http://x/v1", max_concurrency=4) if fallback else None
    decision = decide(ready, 0, target, 0, may_wait, wait=wait, budget_left=budget)
    assert (decision.route, decision.reason) == (route, reason)


def test_completion_rate_and_predicted_wait():
    now = [100.0]
    rate = CompletionRate(window=10.0, clock=lambda: now[0])
    assert rate.rate(["a", "b"]) == 0.0
    assert predicted_wait(1, 0.0) == math.inf
    for _ in range(20):
        rate.record("a")
    for _ in range(10):
        rate.record("b")
    assert rate.rate(["a", "b"]) == 3.0  # 30 completions in a 10 s window
    assert rate.rate(["a"]) == 2.0  # only the model's own endpoints count
    assert predicted_wait(6, rate.rate(["a", "b"])) == 2.0  # sixth in line
    now[0] = 105.0
    rate.record("a")
    now[0] = 110.5  # the first 30 left the window
    assert rate.rate(["a", "b"]) == 0.1
    tracemalloc.start()
    try:
        for _ in range(100):
            now[0] += 1.0
            rate.record("c")
        held, _ = tracemalloc.get_traced_memory()
        for _ in range(10_000):  # memory stays bounded by the window even when not read
            now[0] += 1.0
            rate.record("c")
        grown = tracemalloc.get_traced_memory()[0] - held
    finally:
        tracemalloc.stop()
    assert grown < 4096  # 10,000 more records, and the same few in the window


def test_saturation_thresholds():
    t = Thresholds(max_waiting=4, max_kv_usage=0.9, max_in_flight=10)
    assert not saturated(Candidate("a", waiting=3, kv_usage=0.5, in_flight=9), t)
    assert saturated(Candidate("a", waiting=4), t)
    assert saturated(Candidate("a", kv_usage=0.95), t)
    assert saturated(Candidate("a", in_flight=10), t)
    assert not saturated(Candidate("a"), t)  # unknown (stale) is not saturated


def _router(presume_home: bool = False):
    from kubellm.gateway.routing.replicas.load import LoadView
    from kubellm.gateway.routing.replicas.outliers import OutlierDetector
    from kubellm.gateway.routing.router import Router

    return Router(LoadView(), OutlierDetector(), random.Random(0), presume_home=presume_home)


def _target(urls):
    from kubellm.gateway.discovery.base import Endpoint, ModelTarget

    return ModelTarget("m", "m", endpoints=tuple(Endpoint(u) for u in urls))


def test_a_cold_prompt_spilled_off_its_home_is_not_pinned_to_where_it_spilled():
    """Gateway a sees a new prefix while its home is past the bound and sends it to the
    next replica; gateway b sees it later, home within bound. Their next requests on it
    must agree: home, not where a alone once sent it."""
    a, b = _router(presume_home=True), _router(presume_home=True)  # --front-ends 2
    urls = [f"http://e{i}" for i in range(4)]
    target = _target(urls)
    system = {"role": "system", "content": "tenant policy text " * 40}
    first = routing_request("m", {"messages": [system, {"role": "user", "content": "a"}]}, None)
    later = routing_request("m", {"messages": [system, {"role": "user", "content": "b"}]}, None)
    home, second, *_ = _rendezvous_order(first, urls)
    busy = [Candidate(u, load={home: 5, second: 1}.get(u, 0)) for u in urls]
    spilled = a.order(target, first, busy)[0].url
    assert spilled == second
    a.routed(first, spilled, urls)
    b.routed(first, b.order(target, first, [Candidate(u) for u in urls])[0].url, urls)
    idle = [Candidate(u) for u in urls]
    assert a.order(target, later, idle)[0].url == b.order(target, later, idle)[0].url == home
    # a warm prompt's spill is indexed as usual: a hot prefix may live on two replicas
    a.routed(later, second, urls)
    assert a.index.matched(second, later.chunk_hashes) > 0


def test_unshared_traffic_sends_cold_prompts_by_load_and_shared_traffic_home():
    router = _router()
    urls = [f"http://e{i}" for i in range(4)]
    target = _target(urls)

    def unique(k: int) -> RoutingRequest:
        return routing_request(
            "m", {"messages": [{"role": "user", "content": f"{k} " * 200}]}, None
        )

    probe = unique(10_000)
    home = _rendezvous_order(probe, urls)[0]
    # the home busier than the others, within the bound (cap 4)
    loads = [
        Candidate(u, load=3 if u == home else 2, in_flight=3 if u == home else 2) for u in urls
    ]
    assert router.order(target, probe, loads)[0].url == home  # no evidence yet: home
    for k in range(router.sharing.window):  # a full window of prompts seen nowhere before
        router.routed(unique(k), urls[k % 4], urls)
    assert router.sharing.low("m")
    assert router.order(target, probe, loads)[0].url != home  # the lighter replicas now
    # the same model's traffic turning shared switches it back
    again = unique(1)
    for _ in range(router.sharing.window):
        router.routed(again, home, urls)
    assert not router.sharing.low("m")
    assert router.order(target, probe, loads)[0].url == home


def test_a_request_stays_on_its_prefix_holder_past_the_bound_but_not_past_the_slack():
    """The router widens the bound (HOLDER_SLACK) for a replica holding the prompt's prefix:
    a spill would prefill the whole prefix elsewhere and copy it into a second cache. A
    replica merely as busy that does not hold it is not widened, and past the wider bound
    the request spills as before."""
    from kubellm.gateway.routing.router import HOLDER_SLACK

    router = _router()
    urls = [f"http://e{i}" for i in range(4)]
    target = _target(urls)
    system = {"role": "system", "content": "tenant policy text " * 40}
    first = routing_request("m", {"messages": [system, {"role": "user", "content": "a"}]}, None)
    later = routing_request("m", {"messages": [system, {"role": "user", "content": "b"}]}, None)
    home = _rendezvous_order(first, urls)[0]
    router.routed(first, home, urls)  # the prefix is held at home

    def loads(at_home: int) -> list[Candidate]:
        return [Candidate(u, load=at_home if u == home else 1) for u in urls]

    # home at 5, others 1: total 8, bound cap ceil(1.25 * 9 / 4) = 3, widened cap 6
    assert capacity([5, 1, 1, 1], target.routing.load_bound) == 3
    assert capacity([5, 1, 1, 1], target.routing.load_bound * HOLDER_SLACK) == 6
    assert router.order(target, later, loads(5))[0].url == home
    # at 7 (total 10, widened cap ceil(2.5 * 11 / 4) = 7): 7 + 1 > 7, so it spills
    assert router.order(target, later, loads(7))[0].url != home
    # a prompt home holds nothing of, where nothing presumes a holder (the presumption
    # of the next test off): the plain bound, home at 5 is out
    router.shared.sharing = None
    fresh = routing_request("m", {"messages": [{"role": "system", "content": "q " * 400}]}, None)
    fresh_home = _rendezvous_order(fresh, urls)[0]
    busy = [Candidate(u, load=5 if u == fresh_home else 1) for u in urls]
    assert router.order(target, fresh, busy)[0].url != fresh_home


def test_a_single_front_end_presumes_no_holder_so_an_unseen_prompt_spills_off_a_busy_home():
    """One front end (`--front-ends 1`, the default) knows every holder it made: a prompt
    it never saw gets the plain load bound at its home, so unique prompts do not queue
    there up to the holders' bound (bench/gateway/slo_routing.py, mixed pool: prefix-aware's
    90%-rate 25.2 req/s with the presumption, 42.4 without)."""
    router = _router()
    urls = [f"http://e{i}" for i in range(4)]
    target = _target(urls)
    fresh = routing_request("m", {"messages": [{"role": "user", "content": "q " * 400}]}, None)
    home = _rendezvous_order(fresh, urls)[0]
    busy = [Candidate(u, load=5 if u == home else 1) for u in urls]  # plain cap 3, wide 6
    assert router.order(target, fresh, busy)[0].url != home
    assert _router(presume_home=True).order(target, fresh, busy)[0].url == home


def test_a_front_end_that_never_saw_a_prefix_keeps_it_on_its_busy_home_as_the_others_do():
    """Active-active: front end a sent a prefix home; b, behind the same address, never saw
    it. Unless b's own traffic says prompts do not repeat (a full window of samples without
    a repeat), b presumes the prompt's home holds it (every front end starts a prefix there)
    and gives it the holders' bound, as a does, instead of spilling it off its home and
    prefilling it again elsewhere: from b's first request, since with N front ends b sees a
    prefix's repeats 1/N as often (waiting for one left b spilling for most of a run)."""
    a, b = _router(presume_home=True), _router(presume_home=True)  # --front-ends 2
    urls = [f"http://e{i}" for i in range(4)]
    target = _target(urls)
    system = {"role": "system", "content": "tenant policy text " * 40}
    first = routing_request("m", {"messages": [system, {"role": "user", "content": "a"}]}, None)
    later = routing_request("m", {"messages": [system, {"role": "user", "content": "b"}]}, None)
    home = _rendezvous_order(first, urls)[0]
    a.routed(first, home, urls)
    # home at 5, others 1: the plain cap is 3, the holders' 6
    busy = [Candidate(u, load=5 if u == home else 1) for u in urls]
    assert a.order(target, later, busy)[0].url == home
    assert b.order(target, later, busy)[0].url == home  # b has seen nothing: presumed
    unique = [routing_request("m", {"messages": [{"role": "user", "content": f"{k} " * 200}]},
                              None) for k in range(b.sharing.window)]  # fmt: skip
    for k, other in enumerate(unique[:8]):  # a few prompts never seen before: no verdict
        b.routed(other, urls[k % 4], urls)
    assert b.sharing.may_share("m")
    assert b.order(target, later, busy)[0].url == home
    for k, other in enumerate(unique[8:]):  # a full window of them: b's traffic is unshared
        b.routed(other, urls[k % 4], urls)
    assert not b.sharing.may_share("m")
    assert b.order(target, later, busy)[0].url != home
    for _ in range(b.sharing.low_below):  # beginnings repeat again: the presumption is back
        b.routed(unique[0], urls[0], urls)
    assert b.sharing.may_share("m") and not b.sharing.low("m")
    assert b.order(target, later, busy)[0].url == home
    # past the holders' bound it spills, as on a
    hot = [Candidate(u, load=7 if u == home else 1) for u in urls]
    assert a.order(target, later, hot)[0].url != home
    assert b.order(target, later, hot)[0].url != home


def test_a_filter_registered_for_every_profile_applies_in_each(monkeypatch):
    """Adding a filter is one registration (the canary's revision filter is one); such a
    filter narrows outright: what it drops the profile does not offer (the admission pass
    offers the other revision's replicas after all of the request's own, routing/dispatch.py)."""
    from kubellm.gateway.routing import profiles

    monkeypatch.setattr(profiles, "REGISTRY", dict(profiles.REGISTRY))
    monkeypatch.setattr(profiles, "EVERY_PROFILE", [])

    class OnlyB:
        def bind(self, cycle: profiles.Cycle):  # type: ignore[no-untyped-def]
            return lambda candidates, bound: [c for c in candidates if c.url == "b"]

    profiles.register("only-b", every_profile=True)(lambda shared: OnlyB())
    built = Profiles(Shared(prefix.PrefixIndex(), SessionTable()), cold=lambda request: False)
    request = routing_request("m", {"prompt": "p" * 600}, None)
    candidates = [Candidate(u, load=n) for u, n in (("a", 0), ("b", 3), ("c", 0))]
    for name in profiles.PROFILES:
        target = ModelTarget("m", "m", routing=Routing(policy=name))
        ordered = built.order(target, request, candidates, random.Random(0))
        assert [c.url for c in ordered] == ["b"], name


def test_every_declared_member_is_registered():
    from kubellm.gateway.routing import profiles

    for name, spec in profiles.PROFILES.items():
        for member in (*spec.filters, *(m for m, _ in spec.scorers)):
            assert member in profiles.REGISTRY, (name, member)
        assert spec.cold is None or spec.cold in profiles.PROFILES


def test_front_ends_flag_turns_the_presumption_on_and_refuses_under_one(capsys):
    """`--front-ends N` reaches the router (over 1: a home is presumed to hold an unseen
    prompt); 0 or less is a usage error naming the flag, not a silent default."""
    import argparse

    from kubellm.gateway.routing import flags
    from kubellm.gateway.routing.scheduler import Scheduler

    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    one = flags.settings_from(parser.parse_args([]))
    two = flags.settings_from(parser.parse_args(["--front-ends", "2"]))
    assert (one.front_ends, two.front_ends) == (1, 2)
    from kubellm.gateway.discovery.base import FixedDiscovery

    assert Scheduler(FixedDiscovery({}), one).router.shared.sharing is None
    assert Scheduler(FixedDiscovery({}), two).router.shared.sharing is not None
    with pytest.raises(SystemExit):
        parser.parse_args(["--front-ends", "0"])
    assert "--front-ends: must be at least 1" in capsys.readouterr().err


def test_one_kept_candidate_asks_only_the_scorers_that_keep_state():
    """Where the filters keep one candidate its scores cannot change the order: a
    stateless scorer is not asked, a stateful one (round robin's turn) still is, and the
    random tie-break is drawn as the full ranking draws it."""
    from kubellm.gateway.routing.scorers.picker import Profile, pick
    from kubellm.gateway.routing.scorers.round_robin import RoundRobinScorer

    class Refuses:
        name, stateless = "refuses", True

        def score(self, request: RoutingRequest, candidates: object) -> list[float]:
            raise AssertionError("a stateless scorer was asked about one candidate")

    turns = RoundRobinScorer()
    request = RoutingRequest("m")
    one = [Candidate("http://a", load=0.0)]
    profile = Profile([within_bound], [(Refuses(), 1.0), (turns, 1.0)])
    drawn = random.Random(3)
    assert pick(profile, request, one, 1.25, drawn) == one
    reference = random.Random(3)
    reference.random()  # one tie-break, as the sort draws it for one candidate
    assert drawn.random() == reference.random()
    two = [Candidate("http://a"), Candidate("http://b")]
    # the turn advanced on the one-candidate pick: the next goes to the second in turn
    assert pick(Profile([], [(turns, 1.0)]), request, two, 1.25)[0].url == "http://b"


def test_a_filtered_out_candidate_still_comes_last_by_load():
    from kubellm.gateway.routing.scorers.picker import Profile, pick

    busy = [Candidate("http://a", load=9.0), Candidate("http://b"), Candidate("http://c", load=8.0)]
    only_b = Profile([lambda cs, _: [c for c in cs if c.url == "http://b"]], [])
    assert [c.url for c in pick(only_b, RoutingRequest("m"), busy, 1.25)] == [
        "http://b", "http://c", "http://a",
    ]  # fmt: skip


def test_one_candidate_is_ordered_as_binding_every_member_orders_it():
    """A request with one candidate: the profiles whose members could not change its
    place skip binding (`Member.lone`), and the result, the rng's draws and the prefix
    index's tiers are as if every member had been bound and the picker had ranked it."""
    from kubellm.gateway.routing.scorers.picker import pick

    one = [Candidate("http://a", load=3.0, waiting=2.0, kv_usage=0.5)]
    request = routing_request("m", {"messages": [{"role": "user", "content": "x " * 400}]}, "s")
    for policy in ("prefix-aware", "least-load", "round-robin", "slo-aware"):
        target = ModelTarget("m", "m", routing=Routing(policy=policy), kv_tier_tokens=(4096, 8192))
        fast, full = _Declared(policy), _Declared(policy)
        drawn, reference = random.Random(5), random.Random(5)
        got = fast.profiles.order(target, request, one, drawn, policy)
        profile, bound = full.profiles.bind(policy, target, request, one)
        assert got == pick(profile, bound, one, target.routing.load_bound, reference) == one
        assert drawn.random() == reference.random(), policy
        index = fast.profiles.shared.index
        assert index._tiers == full.profiles.shared.index._tiers, policy


def test_a_stateful_scorer_is_still_asked_about_one_candidate():
    """Round robin keeps its turn: a profile with it binds and asks it for one candidate."""
    rr = _Declared("round-robin")
    target = ModelTarget("m", "m", routing=Routing(policy="round-robin"))
    request = RoutingRequest("m")
    rr.profiles.order(target, request, [Candidate("http://a")], random.Random(1), "round-robin")
    two = [Candidate("http://a"), Candidate("http://b")]
    first = rr.profiles.order(target, request, two, random.Random(1), "round-robin")
    assert first[0].url == "http://b"  # the turn the lone request took
