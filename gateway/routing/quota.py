"""Quotas per tenant: requests and tokens per minute, and the fallback's tokens per day.

Counts live in fixed windows (the current UTC minute, or day) in a `Store`: the in-process
`MemoryStore` for one gateway, or `RedisStore` when several gateway replicas must share one
quota (Envoy's global rate-limit service keeps its counts in Redis the same way). A window's
keys expire with it, so the store holds two windows per tenant at most.

- A request is admitted while its tenant's requests in this minute are under
  `requestsPerMinute` and its tokens (those charged plus this request's estimated prompt)
  fit `tokensPerMinute`; it is charged one request and its estimated prompt at once, and at
  its end the difference to its `usage` (prompt + completion tokens), so concurrent
  requests see each other's reservations.
- A refusal is a 429 with `Retry-After` (the seconds left in the window) and OpenAI's
  `x-ratelimit-limit-*`, `x-ratelimit-remaining-*` and `x-ratelimit-reset-*` headers, which
  the official client reads.

`verdict` is the pure arithmetic; `Limiter` does the store's I/O around it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kubellm.gateway.protocol.errors import GatewayError

MINUTE = 60
DAY = 86400


class Store(Protocol):
    """Counters in windows: `add` returns the new value; keys expire after `ttl` seconds."""

    async def add(self, key: str, amount: int, ttl: int) -> int: ...

    async def get(self, key: str) -> int: ...


class MemoryStore:
    """Counters in this process (one gateway replica), with a controllable clock."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._values: dict[str, tuple[int, float]] = {}

    async def add(self, key: str, amount: int, ttl: int) -> int:
        now = self.clock()
        value, expires = self._values.get(key, (0, now + ttl))
        if expires <= now:
            value, expires = 0, now + ttl
        value += amount
        self._values[key] = (value, expires)
        if len(self._values) > 4096:  # expired windows go; a bound on the map
            self._values = {k: v for k, v in self._values.items() if v[1] > now}
        return value

    async def get(self, key: str) -> int:
        value, expires = self._values.get(key, (0, 0.0))
        return value if expires > self.clock() else 0


class RedisStore:
    """Counters in Redis, shared by every gateway replica that names the same server
    (`--quota-redis redis://host:6379/0`). INCRBY and EXPIRE in one transaction; each call
    bounded by `timeout` seconds."""

    def __init__(self, url: str, timeout: float = 0.5, prefix: str = "kubellm:quota:") -> None:
        import redis.asyncio as redis  # the optional extra `gateway-quota`

        self.prefix = prefix
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    async def add(self, key: str, amount: int, ttl: int) -> int:
        name = self.prefix + key
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.incrby(name, amount)
            pipe.expire(name, ttl, nx=True)
            value, _ = await pipe.execute()
        return int(value)

    async def get(self, key: str) -> int:
        value = await self.client.get(self.prefix + key)
        return int(value or 0)

    async def close(self) -> None:
        await self.client.aclose()


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    limit_requests: int | None
    remaining_requests: int | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_seconds: float
    which: str = ""  # "requests" or "tokens" when refused


def window(now: float, length: int = MINUTE) -> tuple[int, float]:
    """The window `now` falls in, and the seconds until it ends."""
    index = int(now // length)
    return index, (index + 1) * length - now


def verdict(
    now: float,
    requests_used: int,
    tokens_used: int,
    estimate: int,
    requests_per_minute: int | None,
    tokens_per_minute: int | None,
) -> Verdict:
    """Whether a request estimated at `estimate` prompt tokens fits its tenant's quotas this
    minute, given what this minute has used so far."""
    _, reset = window(now)
    rem_req = None if requests_per_minute is None else max(requests_per_minute - requests_used, 0)
    rem_tok = None if tokens_per_minute is None else max(tokens_per_minute - tokens_used, 0)
    which = ""
    if rem_req is not None and rem_req < 1:
        which = "requests"
    elif rem_tok is not None and (rem_tok <= 0 or (tokens_used > 0 and estimate > rem_tok)):
        which = "tokens"  # the first request of a window always fits (it may be large)
    return Verdict(
        not which, requests_per_minute, rem_req, tokens_per_minute, rem_tok, reset, which
    )


def headers(v: Verdict) -> dict[str, str]:
    """OpenAI's rate-limit headers for a verdict (and `Retry-After` when refused)."""
    out: dict[str, str] = {}
    reset = f"{max(v.reset_seconds, 0.001):.3f}s"
    if v.limit_requests is not None:
        out["x-ratelimit-limit-requests"] = str(v.limit_requests)
        out["x-ratelimit-remaining-requests"] = str(max((v.remaining_requests or 0) - 1, 0))
        out["x-ratelimit-reset-requests"] = reset
    if v.limit_tokens is not None:
        out["x-ratelimit-limit-tokens"] = str(v.limit_tokens)
        out["x-ratelimit-remaining-tokens"] = str(v.remaining_tokens or 0)
        out["x-ratelimit-reset-tokens"] = reset
    if not v.allowed:
        out["Retry-After"] = str(max(1, math.ceil(v.reset_seconds)))
    return out


def refusal(tenant: str, v: Verdict) -> GatewayError:
    """The 429 of a tenant over its quota."""
    unit = "requests" if v.which == "requests" else "tokens"
    limit = v.limit_requests if v.which == "requests" else v.limit_tokens
    return GatewayError(
        429,
        f"Tenant `{tenant}` is over its quota of {limit} {unit} per minute; retry after "
        f"{max(1, math.ceil(v.reset_seconds))} s.",
        "rate_limit_error",
        "rate_limit_exceeded",
        headers=headers(v),
    )


class Limiter:
    """The quota checks of one gateway process over a `Store`."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock

    @staticmethod
    def _keys(tenant: str, index: int) -> tuple[str, str]:
        return f"{tenant}:req:{index}", f"{tenant}:tok:{index}"

    async def admit(
        self, tenant: str, estimate: int, rpm: int | None, tpm: int | None
    ) -> tuple[Verdict, int]:
        """Check and charge one request; returns the verdict and the window it was charged
        in (pass it to `settle`). Charged first and taken back when refused, so gateways
        sharing a store never admit past the quota between a read and a write (a request
        racing a refused one may see the count high for that moment: refused, not over)."""
        now = self.clock()
        index, _ = window(now)
        req_key, tok_key = self._keys(tenant, index)
        ttl = 2 * MINUTE
        requests = await self.store.add(req_key, 1, ttl) if rpm is not None else 1
        tokens = await self.store.add(tok_key, estimate, ttl) if tpm is not None else estimate
        v = verdict(now, requests - 1, tokens - estimate, estimate, rpm, tpm)
        if not v.allowed:
            if rpm is not None:
                await self.store.add(req_key, -1, ttl)
            if tpm is not None and estimate:
                await self.store.add(tok_key, -estimate, ttl)
        return v, index

    async def settle(self, tenant: str, index: int, correction: int) -> None:
        """Add the difference between a request's real tokens and its estimate to the
        window it was charged in (its own: a request that ran across a minute's end counts
        in the minute it started)."""
        if correction:
            await self.store.add(self._keys(tenant, index)[1], correction, 2 * MINUTE)

    async def fallback_left(self, tenant: str, per_day: int) -> int:
        """Fallback tokens the tenant may still spend today (UTC)."""
        index, _ = window(self.clock(), DAY)
        used = await self.store.get(f"{tenant}:fallback:{index}")
        return max(per_day - used, 0)

    async def fallback_spent(self, tenant: str, tokens: int) -> None:
        index, _ = window(self.clock(), DAY)
        if tokens:
            await self.store.add(f"{tenant}:fallback:{index}", tokens, 2 * DAY)
