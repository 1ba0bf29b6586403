"""Quotas: the per-minute arithmetic with a controlled clock, OpenAI's rate-limit headers,
and one quota held by two gateways' limiters sharing a real Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from kubellm.gateway.routing import quota
from kubellm.gateway.routing.quota import Limiter, MemoryStore, RedisStore, verdict


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


async def test_limiter_counts_a_minute_then_starts_again():
    clock = Clock()
    limiter = Limiter(MemoryStore(clock), clock)
    outcomes = [(await limiter.admit("t", 10, 3, None))[0].allowed for _ in range(4)]
    assert outcomes == [True, True, True, False]
    clock.now += 40.0  # the next minute
    assert (await limiter.admit("t", 10, 3, None))[0].allowed


async def test_tokens_are_reserved_then_settled_to_usage():
    clock = Clock()
    limiter = Limiter(MemoryStore(clock), clock)
    v, window = await limiter.admit("t", 400, None, 1000)
    assert v.allowed
    v2, _ = await limiter.admit("t", 500, None, 1000)  # 400 reserved + 500 fits
    assert v2.allowed
    assert not (await limiter.admit("t", 200, None, 1000))[0].allowed  # 900 + 200 does not
    await limiter.settle("t", window, -300)  # the first used 100, not 400
    assert (await limiter.admit("t", 200, None, 1000))[0].allowed


async def test_fallback_budget_per_day():
    clock = Clock()
    limiter = Limiter(MemoryStore(clock), clock)
    assert await limiter.fallback_left("t", 1000) == 1000
    await limiter.fallback_spent("t", 1200)
    assert await limiter.fallback_left("t", 1000) == 0
    clock.now += quota.DAY
    assert await limiter.fallback_left("t", 1000) == 1000


async def test_two_gateways_share_one_quota_through_redis(redis_url):
    """Two limiters (two gateway replicas) on one Redis: 3x the quota offered, half through
    each, is admitted exactly to the quota; in-process stores would admit twice as much."""
    clock = Clock()
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    stores = [RedisStore(redis_url), RedisStore(redis_url)]
    try:
        limiters = [Limiter(s, clock) for s in stores]

        async def offer(limiter: Limiter, n: int) -> int:
            return sum([(await limiter.admit(tenant, 1, 20, None))[0].allowed for _ in range(n)])

        admitted = await asyncio.gather(offer(limiters[0], 30), offer(limiters[1], 30))
        assert sum(admitted) == 20
        assert all(a > 0 for a in admitted)
        separate = [Limiter(MemoryStore(clock), clock) for _ in range(2)]
        alone = await asyncio.gather(offer(separate[0], 30), offer(separate[1], 30))
        assert sum(alone) == 40  # what a split without a shared store would admit
    finally:
        for s in stores:
            await s.close()
