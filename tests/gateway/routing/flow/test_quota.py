"""Quotas: the per-minute arithmetic with a controlled clock, OpenAI's rate-limit headers,
and one quota held by two gateways' limiters sharing a real Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from kubellm.gateway.routing.flow import quota
from kubellm.gateway.routing.flow.quota import Limiter, MemoryStore, RedisStore, verdict


class Clock:
    def __init__(self, now: float = 1_000_040.0) -> None:  # 20 s into a minute
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("req_used", "tok_used", "estimate", "rpm", "tpm", "allowed", "which"),
    [
        (0, 0, 100, None, None, True, ""),  # no quota
        (9, 0, 100, 10, None, True, ""),
        (10, 0, 100, 10, None, False, "requests"),
        (0, 900, 100, None, 1000, True, ""),  # fits exactly
        (0, 901, 100, None, 1000, False, "tokens"),
        (0, 1000, 1, None, 1000, False, "tokens"),
        (0, 0, 5000, None, 1000, True, ""),  # the first of a window always fits
        (10, 2000, 1, 10, 1000, False, "requests"),  # requests named first
    ],
)
def test_verdict(req_used, tok_used, estimate, rpm, tpm, allowed, which):
    v = verdict(1_000_040.0, req_used, tok_used, estimate, rpm, tpm)
    assert (v.allowed, v.which) == (allowed, which)
    assert v.reset_seconds == pytest.approx(40.0)


def test_refusal_carries_retry_after_and_openai_headers():
    v = verdict(1_000_040.5, 10, 700, 1, 10, 1000)
    error = quota.refusal("nightly-eval", v)
    assert error.status == 429
    assert error.body()["error"]["code"] == "rate_limit_exceeded"
    assert error.headers["Retry-After"] == "40"  # 39.5 s left, rounded up
    assert error.headers["x-ratelimit-limit-requests"] == "10"
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    assert error.headers["x-ratelimit-limit-tokens"] == "1000"
    assert error.headers["x-ratelimit-remaining-tokens"] == "300"
    assert error.headers["x-ratelimit-reset-tokens"] == "39.500s"
    assert "nightly-eval" in error.message


def reserving(tokens: int) -> quota.Reservation:
    return quota.Reservation(tokens)


async def test_limiter_counts_a_minute_then_starts_again():
    clock = Clock()
    limiter = Limiter(MemoryStore(clock), clock)
    outcomes = [(await limiter.admit("t", reserving(10), 3, None)).allowed for _ in range(4)]
    assert outcomes == [True, True, True, False]
    clock.now += 40.0  # the next minute
    assert (await limiter.admit("t", reserving(10), 3, None)).allowed


async def test_tokens_are_reserved_then_settled_to_usage():
    clock = Clock()
    limiter = Limiter(MemoryStore(clock), clock)
    first = reserving(400)
    assert (await limiter.admit("t", first, None, 1000)).allowed
    assert (await limiter.admit("t", reserving(500), None, 1000)).allowed  # 400 + 500 fits
    assert not (await limiter.admit("t", reserving(200), None, 1000)).allowed  # 900 + 200 not
    await limiter.settle("t", first, 100)  # the first used 100 of its 400
    assert (await limiter.admit("t", reserving(200), None, 1000)).allowed
    assert first.window is None  # settled once


async def test_an_excess_is_charged_to_the_current_minute_a_refund_to_its_own():
    clock = Clock()
    store = MemoryStore(clock)
    limiter = Limiter(store, clock)
    late, early = reserving(100), reserving(100)
    await limiter.admit("t", late, None, 1000)
    await limiter.admit("t", early, None, 1000)
    clock.now += 40.0  # the next minute
    await limiter.settle("t", late, 700)  # 600 past its bound: charged now
    await limiter.settle("t", early, 0)  # nothing served: refunded to its minute
    index = quota.window(clock.now)[0]
    assert await store.get(f"t:tok:{index}") == 600
    assert await store.get(f"t:tok:{index - 1}") == 100


async def test_fallback_budget_per_day_is_reserved_then_settled():
    clock = Clock()
    store = MemoryStore(clock)
    limiter = Limiter(store, clock)
    a, b, c = reserving(400), reserving(400), reserving(400)
    assert await limiter.reserve_fallback("t", a, 1000)
    assert await limiter.reserve_fallback("t", b, 1000)
    assert not await limiter.reserve_fallback("t", c, 1000)  # 1,200 > 1,000: not sent
    await limiter.release_fallback("t", b)  # b went to a replica
    await limiter.settle("t", a, 300, fallback=True)
    assert await store.get(f"t:fallback:{quota.window(clock.now, quota.DAY)[0]}") == 300
    assert await limiter.reserve_fallback("t", c, 1000)
    clock.now += quota.DAY
    assert await limiter.reserve_fallback("t", reserving(1000), 1000)


async def test_two_gateways_share_one_quota_through_redis(redis_url):
    """Two limiters (two gateway replicas) on one Redis: 3x the quota offered, half through
    each, is admitted exactly to the quota; in-process stores would admit twice as much."""
    clock = Clock()
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    stores = [RedisStore(redis_url), RedisStore(redis_url)]
    try:
        limiters = [Limiter(s, clock) for s in stores]

        async def offer(limiter: Limiter, n: int) -> int:
            return sum(
                [(await limiter.admit(tenant, reserving(1), 20, None)).allowed for _ in range(n)]
            )

        admitted = await asyncio.gather(offer(limiters[0], 30), offer(limiters[1], 30))
        assert sum(admitted) == 20
        assert all(a > 0 for a in admitted)
        separate = [Limiter(MemoryStore(clock), clock) for _ in range(2)]
        alone = await asyncio.gather(offer(separate[0], 30), offer(separate[1], 30))
        assert sum(alone) == 40  # what a split without a shared store would admit
    finally:
        for s in stores:
            await s.close()


class Counting:
    """A store that counts the calls that reach it (the real store underneath)."""

    def __init__(self, store: quota.Store) -> None:
        self.store = store
        self.calls = 0

    async def add(self, key: str, amount: int, ttl: int) -> int:
        self.calls += 1
        return await self.store.add(key, amount, ttl)

    async def get(self, key: str) -> int:
        self.calls += 1
        return await self.store.get(key)


async def test_a_hung_redis_costs_one_timeout_not_one_per_request(caplog):
    """A real redis-server frozen with SIGSTOP (it accepts, never answers): every quota'd
    request waited the store's whole timeout and logged a warning. Now the first failure
    opens a breaker: the next requests are admitted at once without asking the store
    (quotas fail open), one failure is counted and one line logged; once the server answers
    and the breaker's open time has passed, the quota counts again."""
    import signal

    from kubellm.gateway.routing.flow.controller import Caller, Tenancy, TenancySettings
    from kubellm.gateway.routing.flow.tenants import parse
    from prometheus_client import CollectorRegistry

    from tests.fixtures.redis import redis_server

    with redis_server() as (url, process):
        registry = CollectorRegistry()
        store = Counting(RedisStore(url, timeout=0.3))
        settings = TenancySettings(parse({"tenants": [{"name": "t", "requestsPerMinute": 3}]}))
        tenancy = Tenancy(settings, registry, store=store)
        tenant = settings.tenants.tenants[0]
        try:
            process.send_signal(signal.SIGSTOP)
            for _ in range(8):
                assert (
                    await tenancy.admit(Caller(tenant, 0, "t"), {"prompt": "x"}) is None
                )  # fail open
            assert store.calls == 1
            assert registry.get_sample_value("kubellm_gateway_quota_store_failures_total") == 1
            warnings = [r for r in caplog.records if r.levelname == "WARNING"]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]
        finally:
            process.send_signal(signal.SIGCONT)
        breaker = tenancy.limiter.store
        clock = Clock(breaker.clock() + 3600)  # past the open time
        breaker.clock = clock
        outcomes = []
        for _ in range(4):
            outcomes.append(await tenancy.admit(Caller(tenant, 0, "t"), {"prompt": "x"}) is None)
        assert outcomes == [True, True, True, False]  # the quota holds again
        await tenancy.close()
