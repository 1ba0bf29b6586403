"""Flow control's pure decisions: strict bands, weighted VTC fairness inside a band, the
lift of a joining tenant, bounds with drop reasons, sheddable first, the headroom line."""

from __future__ import annotations

import itertools
import math
from collections import deque
from math import inf

import pytest
from kubellm.gateway.routing.flow.queues import (
    DEFAULT_OUTPUT_TOKENS,
    LOW_RAMP,
    Flow,
    FlowSettings,
    Waiter,
    allowances,
    below_line,
    drained,
    estimate_prompt_tokens,
    expected_output_tokens,
    fair_capacity,
    observed_output,
    owner_of,
)
from kubellm.gateway.routing.scorers.base import Candidate


def waiter(tenant: str, band: int = 0, weight: float = 1.0, cost: float = 100) -> Waiter:
    return Waiter(tenant, band, weight, cost)


def drain(flow: Flow, serve: dict[str, float] | None = None, n: int = 100) -> list[str]:
    """Dispatch up to `n` waiters in flow order, charging each its cost (x `serve`)."""
    order = []
    for _ in range(n):
        head = flow.head()
        if head is None:
            break
        flow.leave(head)
        flow.charge(head.tenant, head.cost * (serve or {}).get(head.tenant, 1), head.weight)
        order.append(head.tenant)
    return order


def test_bands_are_strict():
    flow = Flow()
    for w in (waiter("batch", -1), waiter("chat", 10), waiter("tool", 0), waiter("chat", 10)):
        flow.join(w)
    assert drain(flow) == ["chat", "chat", "tool", "batch"]


def test_inside_a_band_the_least_served_tenant_goes_first():
    flow = Flow()
    for tenant in ("a", "a", "b"):
        flow.join(waiter(tenant))
    flow.vtc.update({"a": 500.0, "b": 0.0})
    assert flow.head().tenant == "b"
    flow.vtc.update({"a": 0.0, "b": 500.0})
    assert flow.head().tenant == "a"


def test_equal_weights_share_tokens_equally_whatever_the_request_sizes():
    """Three backlogged tenants whose requests cost 200, 2,000 and 8,000 tokens: served by
    VTC, each gets about a third of the tokens (first come first served would give the
    largest most); Jain's index >= 0.98."""
    flow = Flow()
    cost = {"small": 200, "medium": 2000, "large": 8000}
    served = dict.fromkeys(cost, 0.0)
    for tenant in cost:
        for _ in range(32):
            flow.join(waiter(tenant, cost=cost[tenant]))
    for _ in range(900):
        head = flow.head()
        flow.leave(head)
        flow.charge(head.tenant, head.cost, head.weight)
        served[head.tenant] += head.cost
        flow.join(waiter(head.tenant, cost=head.cost))  # always backlogged
    total = sum(served.values())
    shares = [v / total for v in served.values()]
    jain = sum(shares) ** 2 / (len(shares) * sum(s * s for s in shares))
    assert jain >= 0.98, shares
    assert all(abs(s - 1 / 3) < 0.1 for s in shares), shares


def test_weights_2_1_1_give_50_25_25():
    flow = Flow()
    weights = {"a": 2.0, "b": 1.0, "c": 1.0}
    served = dict.fromkeys(weights, 0.0)
    for tenant, weight in weights.items():
        for _ in range(8):
            flow.join(waiter(tenant, weight=weight))
    for _ in range(400):
        head = flow.head()
        flow.leave(head)
        flow.charge(head.tenant, head.cost, head.weight)
        served[head.tenant] += head.cost
        flow.join(waiter(head.tenant, weight=head.weight))
    total = sum(served.values())
    assert served["a"] / total == pytest.approx(0.5, abs=0.02)
    assert served["b"] / total == pytest.approx(0.25, abs=0.02)


def test_a_tenant_joining_late_gets_no_credit_for_its_idle_time():
    """VTC's lift: the newcomer starts at the lowest counter of the backlogged tenants, so
    it shares from now on instead of taking every slot until it caught up."""
    flow = Flow()
    flow.join(waiter("old"))
    flow.vtc["old"] = 10_000.0
    flow.join(waiter("new"))
    assert flow.vtc["new"] == 10_000.0
    for _ in range(5):
        flow.join(waiter("old"))
        flow.join(waiter("new"))
    order = drain(flow, n=8)
    assert order.count("new") == 4 and order.count("old") == 4


def test_fifo_within_a_tenant():
    flow = Flow()
    first, second = waiter("a", cost=1), waiter("a", cost=2)
    flow.join(first)
    flow.join(second)
    assert flow.head() is first


@pytest.mark.parametrize(
    ("queued", "new_band", "dropped", "reason"),
    [
        # the band is full of one tenant's waiters: its newest makes way for another tenant
        ([(0, "x")] * 2, 0, "x", "shed"),
        # the band is shared evenly: the newcomer is dropped
        ([(0, "x"), (0, "new")], 0, "new", "band-full"),
        # one tenant holds the newcomer's band: its newest goes
        ([(0, "x"), (1, "y"), (1, "y")], 1, "y", "shed"),
        # the model's queue is full: the newest sheddable waiter below goes
        ([(-1, "batch"), (-1, "batch2"), (5, "x")], 10, "batch2", "shed"),
        # nothing below the newcomer is sheddable: the newcomer is dropped
        ([(0, "x"), (3, "y"), (5, "z")], 10, "new", "queue-full"),
        # a sheddable newcomer does not shed its own band
        ([(-1, "batch"), (0, "y"), (5, "z")], -1, "new", "queue-full"),
        # the lowest sheddable band goes first
        ([(-1, "b1"), (-5, "b5"), (4, "z")], 10, "b5", "shed"),
    ],
)
def test_bounds_drop_with_a_reason_sheddable_first(queued, new_band, dropped, reason):
    flow = Flow(FlowSettings(max_band=2, max_total=3))
    waiters = {}
    for band, tenant in queued:
        waiters[tenant] = w = waiter(tenant, band)
        flow.join(w)
    new = waiters["new"] = waiter("new", new_band)
    out = flow.join(new)
    assert [w.tenant for w in out] == [dropped]
    assert waiters[dropped].dropped == reason
    if dropped != "new":
        assert new.dropped is None and len(flow) == len(queued)


def test_leave_is_idempotent_and_empties_the_queues():
    flow = Flow()
    w = waiter("a")
    flow.join(w)
    flow.leave(w)
    flow.leave(w)
    assert len(flow) == 0 and flow.head() is None and flow.queues == {}


@pytest.mark.parametrize(
    ("candidate", "settings", "below"),
    [
        (Candidate("u", load=3, waiting=0, kv_usage=0.5), FlowSettings(), True),
        (Candidate("u", load=3, waiting=1, kv_usage=0.5), FlowSettings(), False),
        (Candidate("u", load=3, waiting=0, kv_usage=0.85), FlowSettings(), False),
        (Candidate("u", load=3), FlowSettings(), True),  # unknown figures: below
        (Candidate("u", load=12, waiting=0), FlowSettings(headroom_load=12), False),
        (Candidate("u", load=11, waiting=0), FlowSettings(headroom_load=12), True),
    ],
)
def test_the_lower_saturation_line(candidate, settings, below):
    assert below_line(candidate, settings) is below


@pytest.mark.parametrize(
    ("load", "running", "waiting", "below"),
    [
        (17, 16, 0, True),  # the engine had 16 running, not queueing: a few more may go
        (16 + LOW_RAMP, 16, 0, False),  # no more than LOW_RAMP past the scrape before the next
        (LOW_RAMP - 1, None, None, True),  # nothing scraped yet: a few per replica
        (LOW_RAMP, None, None, False),  # ... and no flood before the first scrape
    ],
)
def test_before_its_slots_are_learnt_a_replica_takes_the_low_band_a_few_at_a_time(
    load, running, waiting, below
):
    """Issue 38's interference: with no slots learnt (the engine never queued) the line
    was the scrape's queue alone, so between two scrapes every waiting batch request went
    (64 per replica at once) and chats queued in the engines behind them."""
    candidate = Candidate("a", load=load, in_flight=load, waiting=waiting, running=running)
    assert below_line(candidate, FlowSettings()) is below


@pytest.mark.parametrize(
    ("prefilling", "hold", "below"),
    [
        (0, True, True),  # no high-band stream awaiting its first token there
        (1, True, False),  # one is: low bands go elsewhere until it has it
        (3, True, False),
        (1, False, True),  # the hold off: only the line counts
    ],
)
def test_a_replica_with_a_high_band_prefill_takes_no_low_band(prefilling, hold, below):
    settings = FlowSettings(headroom_load=12, hold_prefill=hold)
    candidate = Candidate("a", load=1, waiting=0, kv_usage=0.1)
    assert below_line(candidate, settings, prefilling) is below


@pytest.mark.parametrize(
    ("debt", "elapsed", "rate", "left"),
    [
        (1000, 0.0, 20_000, 1000),
        (1000, 0.02, 20_000, 600),
        (1000, 0.05, 20_000, 0),  # drained: a low band may go there again
        (1000, 9.0, 20_000, 0),  # never below 0: idle time earns no burst
        (1000, -1.0, 20_000, 1000),  # a clock read out of order drains nothing
    ],
)
def test_the_prefill_debt_drains_at_its_rate(debt, elapsed, rate, left):
    assert drained(debt, elapsed, rate) == pytest.approx(left)


@pytest.mark.parametrize(("debt", "below"), [(0.0, True), (1.0, False)])
def test_a_replica_owing_low_band_prefill_takes_no_more_low_band(debt, below):
    """`debt` is what it owes under the budget that applies (the gate's: 0 without one)."""
    settings = FlowSettings(headroom_load=12)
    candidate = Candidate("a", load=1, waiting=0, kv_usage=0.1)
    assert below_line(candidate, settings, 0, debt) is below


def test_prompt_estimate():
    assert estimate_prompt_tokens({"prompt": "x" * 400}) == 100
    parts = [{"type": "text", "text": "y" * 40}]
    chat = {"messages": [{"role": "user", "content": "x" * 80}, {"role": "user", "content": parts}]}
    assert estimate_prompt_tokens(chat) == 30
    assert estimate_prompt_tokens(None) == 0


def test_the_fallback_goes_to_the_first_waiter_that_may_use_it():
    flow = Flow()
    resident = Waiter("resident", 5, 1.0, 100, fallback=False)
    zero = Waiter("zero", 0, 1.0, 100)
    ten = Waiter("ten", 10, 1.0, 100, fallback=False)
    for w in (resident, zero, ten):
        flow.join(w)
    assert flow.head() is ten
    assert flow.head(fallback=True) is zero
    flow.leave(zero)
    assert flow.head(fallback=True) is None


# ---------------------------------------------------------------- fair in-flight budget


def _dispatched(services: list[float], slots: dict[str, float] | None = None) -> Flow:
    flow = Flow()
    for i, service in enumerate(services):
        flow.started(0, f"t{i % 3}", service)
    flow.slots.update(slots or {})
    return flow


FOUR = [Candidate(f"r{i}") for i in range(4)]
MIX = [400.0] * 5 + [2200.0] * 2 + [8200.0]  # by count, mostly short requests


@pytest.mark.parametrize(
    ("settings", "flow", "cap", "expected"),
    [
        # shipped: each replica's learnt slots x 1.5 x the typical request's service
        (
            FlowSettings(),
            _dispatched(MIX, {f"r{i}": 16 for i in range(4)}),
            None,
            4 * 16 * 1.5 * 400,
        ),
        # replicas not learnt take the learnt ones' mean, or the gateway's cap per replica
        (
            FlowSettings(),
            _dispatched(MIX, {"r0": 16, "r1": 8}),
            None,
            (16 + 8 + 12 + 12) * 1.5 * 400,
        ),
        (FlowSettings(), _dispatched(MIX, {"r0": 16}), 4, (16 + 4 * 3) * 1.5 * 400),
        # nothing known: no bound (no slots learnt and no cap; nothing dispatched)
        (FlowSettings(), _dispatched(MIX), None, None),
        (FlowSettings(), _dispatched([], {"r0": 16}), None, None),
        # the flag's value per replica; off
        (FlowSettings(fair_in_flight_tokens=9600), _dispatched([]), None, 4 * 9600),
        (FlowSettings(fair_in_flight=False), _dispatched(MIX, {"r0": 16}), 16, None),
    ],
    ids=["learnt", "mean of learnt", "cap", "unknown slots", "nothing dispatched", "flag", "off"],
)
def test_the_fair_budget_is_derived_from_the_pool(settings, flow, cap, expected):
    assert fair_capacity(settings, flow, FOUR, cap) == expected


def test_the_typical_service_is_the_first_quartile_of_the_last_requests():
    flow = _dispatched([8200.0] * 300 + MIX * 40)  # the long ones are older than the window
    assert flow.typical() == 400.0
    flow.started(0, "t", 8200.0)  # the cached quantile follows what is dispatched
    assert len(flow.recent) == 256 and flow.typical() == 400.0


@pytest.mark.parametrize(
    ("capacity", "weights", "demands", "expected"),
    [
        # all backlogged: split by weight
        (900, {"a": 1, "b": 1, "c": 1}, {"a": inf, "b": inf, "c": inf}, [300, 300, 300]),
        (800, {"a": 2, "b": 1, "c": 1}, {"a": inf, "b": inf, "c": inf}, [400, 200, 200]),
        # a tenant asking less than its share keeps its demand; the rest is split
        (900, {"a": 1, "b": 1, "c": 1}, {"a": 100, "b": inf, "c": inf}, [100, 400, 400]),
        # every demand met under the capacity
        (900, {"a": 1, "b": 1}, {"a": 100, "b": 200}, [100, 200]),
        # a demand between shares: the water level rises past it
        (900, {"a": 1, "b": 1, "c": 1}, {"a": 100, "b": 350, "c": inf}, [100, 350, 450]),
    ],
)
def test_allowances_are_weighted_max_min_fair(capacity, weights, demands, expected):
    got = allowances(capacity, weights, demands)
    assert [got[t] for t in weights] == pytest.approx(expected)


def test_a_band_with_one_active_tenant_is_not_bounded():
    flow = Flow()
    flow.started(0, "big", 50_000)
    flow.join(waiter("big"))
    assert flow.held(1000) == frozenset()
    assert flow.head(held=flow.held(1000)).tenant == "big"


def test_a_tenant_at_its_in_flight_share_waits_and_the_next_goes_past_it():
    """Capacity 1,000: the light tenant (40 in flight, nothing waiting) keeps its 40; the big
    one may have 960, so with 800 in flight its next 400-token request waits, though the
    replicas would take it; once the light tenant waits too, shares are 500 each."""
    flow = Flow()
    flow.started(0, "light", 40)
    flow.started(0, "big", 800)
    big = Waiter("big", 0, 1.0, 100, service=400)
    flow.join(big)
    flow.vtc.update({"big": 10_000.0, "light": 0.0})
    assert flow.held(1000) == {(0, "big")}
    assert flow.head(held=flow.held(1000)) is None  # waits at the gateway for its share
    light = Waiter("light", 0, 1.0, 10, service=40)
    flow.join(light)
    assert flow.head(held=flow.held(1000)) is light
    flow.ended(0, "big", 400)  # one of its requests ended: 400 in flight, 400 + 400 <= 500?
    assert flow.held(1000) == {(0, "big")}
    flow.ended(0, "big", 300)
    assert flow.held(1000) == frozenset()
    assert flow.vtc["light"] == flow.vtc["big"]  # lifted as it joined: no idle credit
    assert flow.head(held=flow.held(1000)) is big  # ties: the earlier arrival


def test_the_least_served_tenant_may_round_its_share_up_by_one_request():
    """Two tenants waiting, capacity 24,600: 12,300 each, 1.5 of the large tenant's 8,200-
    token requests. With one in flight the second would take it to 16,400, past its share;
    while its counter is the band's lowest it goes anyway (whole requests cannot meet the
    share; the counter evens it out over time), once it is ahead it waits, and at or past
    its allowance it waits however far behind it is."""
    flow = Flow()
    flow.started(0, "small", 12_000)
    flow.started(0, "large", 8200)
    flow.join(Waiter("small", 0, 1.0, 200, service=400))
    flow.join(Waiter("large", 0, 1.0, 8000, service=8200))
    flow.vtc.update({"small": 9000.0, "large": 8200.0})
    assert flow.held(24_600) == {(0, "small")}  # small at its share; large least served
    flow.vtc["large"] = 9500.0
    assert flow.held(24_600) == {(0, "large")}  # ahead: it waits; small may round up
    flow.vtc["large"] = 0.0
    flow.started(0, "large", 8200)  # 16,400 in flight: past its allowance
    assert (0, "large") in flow.held(24_600)


def test_a_tenant_with_nothing_in_flight_goes_when_it_is_the_least_served():
    """A request larger than its tenant's whole share (8,200 against 500 of 1,000) waits
    while another tenant is behind it by counter, and goes once it is the least served (a
    tie counts): whole requests cannot keep the share, the counter keeps it over time, and
    the tenant is never starved (the others' counters grow as they are served)."""
    flow = Flow()
    flow.started(0, "a", 900)
    flow.join(Waiter("b", 0, 1.0, 8000, service=8200))
    flow.vtc.update({"a": 100.0, "b": 8200.0})
    assert flow.held(1000) == {(0, "b")}
    flow.charge("a", 8100, 1.0)  # a was served meanwhile: 8,200, level with b
    assert flow.held(1000) == frozenset()
    flow.charge("a", 1, 1.0)
    assert flow.held(1000) == frozenset()


def test_bands_are_bounded_separately():
    flow = Flow()
    flow.started(10, "chat", 900)
    flow.started(0, "x", 900)
    flow.started(0, "y", 10)
    flow.join(Waiter("chat", 10, 1.0, 10, service=200))  # alone in its band
    flow.join(Waiter("x", 0, 1.0, 10, service=200))
    assert flow.held(1000) == {(0, "x")}


COST = {"small": 400, "medium": 2200, "large": 8200}  # service tokens per request


def fill(
    flow: Flow, running: deque[Waiter], slots: int | None, capacity: float | None
) -> list[Waiter]:
    """Dispatch in flow order (under the budget `capacity`, None: none) until `running`
    holds `slots` (None: no bound) or nothing may go; the waiters dispatched."""
    sent = []
    while slots is None or len(running) < slots:
        head = flow.head(held=flow.held(capacity) if capacity else frozenset())
        if head is None:
            break
        flow.leave(head)
        flow.charge(head.tenant, head.cost, head.weight)
        flow.started(0, head.tenant, head.service)
        running.append(head)
        sent.append(head)
    return sent


def serve(
    capacity: float | None,
    weights: dict[str, float] | None = None,
    outstanding: int = 64,
    slots: int | None = None,
    rounds: int = 3000,
) -> dict[str, float]:
    """Tenants of COST always backlogged (`outstanding` requests each, a finished one sent
    again), dispatched in flow order under the budget `capacity` (None: no budget) into at
    most `slots` in flight, the oldest ending one per round: each tenant's mean service in
    flight."""
    weights = weights or dict.fromkeys(COST, 1.0)
    flow = Flow()
    flow.weights.update(weights)
    running: deque[Waiter] = deque()
    for tenant, c in COST.items():
        for _ in range(outstanding):
            flow.join(Waiter(tenant, 0, weights[tenant], c, service=c))
    mean = dict.fromkeys(COST, 0.0)
    for _ in range(rounds):
        fill(flow, running, slots, capacity)
        for tenant in COST:
            mean[tenant] += flow.in_flight.get(0, {}).get(tenant, 0.0) / rounds
        done = running.popleft()
        flow.ended(0, done.tenant, done.service)
        flow.join(Waiter(done.tenant, 0, done.weight, done.cost, service=done.service))
    return mean


def test_the_budget_gives_backlogged_tenants_equal_service_in_flight():
    """Three tenants always waiting (64 requests each), requests of 400, 2,200 and 8,200
    service tokens, the oldest in flight ending one at a time: with the budget (capacity
    49,200) each tenant's mean service in flight is within 10% of a third; without it, the
    order by counter alone lets the slots fill with the large tenant's service."""
    fair = serve(49_200, slots=120)
    total = sum(fair.values())
    assert all(abs(v / total - 1 / 3) < 0.1 / 3 for v in fair.values()), fair
    unbounded = serve(None, slots=120)
    assert unbounded["large"] > 3 * unbounded["small"], unbounded


@pytest.mark.parametrize(
    "weights",
    [
        {"small": 2.0, "medium": 1.0, "large": 1.0},
        {"small": 1.0, "medium": 2.0, "large": 1.0},
        {"small": 1.0, "medium": 1.0, "large": 2.0},
    ],
)
def test_weights_2_1_1_under_the_budget_give_50_25_25_of_the_service_in_flight(weights):
    """The budget's case the benchmark measures: the small tenant has only its 32 requests
    (12,800 service tokens), so weight 2 on it needs the large tenant held to a quarter of
    25,600, less than one of its 8,200-token requests: it has none in flight part of the
    time and goes when it is the least served. Whichever tenant has weight 2, each mean
    service in flight is within 10% of its weighted share."""
    mean = serve(25_600, weights, outstanding=32, rounds=6000)
    total = sum(mean.values())
    for tenant, weight in weights.items():
        share = weight / sum(weights.values())
        assert abs(mean[tenant] / total - share) < 0.1 * share, (tenant, mean)


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"max_tokens": 100}, 100),
        ({"max_completion_tokens": 50, "max_tokens": 100}, 50),
        ({}, DEFAULT_OUTPUT_TOKENS),
        ({"max_tokens": True}, DEFAULT_OUTPUT_TOKENS),
        (None, DEFAULT_OUTPUT_TOKENS),
    ],
)
def test_expected_output_tokens(body, tokens):
    assert expected_output_tokens(body) == tokens


def test_fairness_ids_split_a_tenants_share_instead_of_multiplying_it():
    """Issue 39 item 3: tenant a sends each request under a fresh fairness id, tenant b
    (equal weight) under none; both always backlogged. Dispatch order and the fair
    in-flight budget both share by tenant: each gets half the service."""
    flow = Flow()
    served = {"a": 0.0, "b": 0.0}
    fresh = itertools.count()

    def send(tenant: str) -> None:
        name = f"a/{next(fresh)}" if tenant == "a" else "b"
        flow.join(Waiter(name, 0, 1.0, 100, service=100))

    for _ in range(8):
        send("a")
        send("b")
    running: deque[Waiter] = deque()
    for _ in range(2000):
        for head in fill(flow, running, 8, 400):
            served[owner_of(head.tenant)] += head.cost
        done = running.popleft()
        flow.ended(0, done.tenant, done.service)
        send(owner_of(done.tenant))
    assert served["a"] / sum(served.values()) == pytest.approx(0.5, abs=0.05), served


def test_a_tenants_flows_share_its_turns_by_their_own_counters():
    flow = Flow()
    for name in ("t/x", "t/x", "t/y", "u"):
        flow.join(waiter(name))
    order = drain(flow, n=4)
    assert [owner_of(t) for t in order[:2]] in (["t", "u"], ["u", "t"])  # tenants alternate
    assert sorted(order) == ["t/x", "t/x", "t/y", "u"]
    assert order.index("t/y") < order.index("t/x", order.index("t/x") + 1)  # flows alternate


def test_a_tenants_observed_output_counts_for_a_request_without_max_tokens():
    observed = None
    for completion in (100, 3000, 50, 50):
        observed = observed_output(observed, completion)
    assert 2800 < observed < 3000  # the largest, decaying
    assert expected_output_tokens({}, observed) == math.ceil(observed)
    assert expected_output_tokens({"max_tokens": 10}, observed) == 10  # named: as named
    assert expected_output_tokens({}, 10) == DEFAULT_OUTPUT_TOKENS  # never below the default


def test_without_headroom_load_a_quarter_of_the_learnt_slots_is_kept_for_high_bands():
    """Issue 38: a tenants file alone keeps headroom. A replica queueing with 16 running
    has 16 slots; sheddable work then goes there only under 12 requests."""
    flow, settings = Flow(), FlowSettings()
    idle = Candidate(url="a", load=13, waiting=0, running=13, kv_usage=0.1)
    assert below_line(idle, settings, slots=flow.slots.get("a"))  # nothing learnt: no bound
    flow.learn([Candidate(url="a", load=18, waiting=2, running=16, kv_usage=0.5)])
    assert flow.slots == {"a": 16}
    assert not below_line(idle, settings, slots=flow.slots.get("a"))
    assert below_line(idle._replace(load=11), settings, slots=flow.slots.get("a"))
    explicit = FlowSettings(headroom_load=14)  # the flag, when given, decides
    assert below_line(idle, explicit, slots=16)
