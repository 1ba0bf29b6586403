"""Quotas per tenant: requests and tokens per minute, and the fallback's tokens per day.

Counts live in fixed windows (the current UTC minute, or day) in a `Store`: the in-process
`MemoryStore` for one gateway, or `RedisStore` when several gateway replicas must share one
quota (Envoy's global rate-limit service keeps its counts in Redis the same way). A window's
keys expire with it, so the store holds two windows per tenant at most.

- **Reserved**: a request is admitted while its tenant's requests in this minute are under
  `requestsPerMinute` and its tokens (those charged, reservations included, plus this
  request's reservation) fit `tokensPerMinute`. It reserves the most it may cost: its
  prompt (`flow.estimate_prompt_tokens`: token ids counted, text at 4 characters a token)
  plus its answer's bound (`usage.output_bound`: max_tokens x choices), charged at once,
  so concurrent requests see each other's reservations.
- **Settled**: at its end the reservation becomes what was served: the upstream's checked
  `usage`, else the gateway's count (prompt estimate, events that carried text). A
  request a replica or the fallback received is charged what was served even when its
  client left; one no upstream received (refused, shed, an error answer) is refunded. A
  refund goes back to the minute it was charged in; an excess (an answer past its bound)
  is charged to the current minute.
- **The fallback's daily budget** is reserved the same way at admission (the request may
  end up there), released when the request goes to a replica, and settled when the
  fallback answered; a request whose reservation does not fit what is left today does not
  go to the fallback.
- A refusal is a 429 with `Retry-After` (the seconds left in the window) and OpenAI's
  `x-ratelimit-limit-*`, `x-ratelimit-remaining-*` and `x-ratelimit-reset-*` headers, which
  the official client reads.
- A store that fails (a Redis down or hung) opens a `Breaker`: for `open_seconds` the
  store is not asked (quotas fail open, fallback budgets fail closed), one line is logged
  per opening (at most one a minute) and each failure counted in
  `kubellm_gateway_quota_store_failures_total`; then one request tries it again.

`verdict` is the pure arithmetic; `Limiter` does the store's I/O around it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from kubellm.gateway.protocol.errors import GatewayError
from prometheus_client import CollectorRegistry, Counter

from kubellm import metrics

log = logging.getLogger("kubellm.gateway.quota")

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


class StoreUnavailable(Exception):
    """The quota store failed, or its breaker is open: the caller fails open (or closed)."""


class Breaker:
    """A `Store` that stops asking a failing one: after a failure, every call fails at once
    (`StoreUnavailable`) for `open_seconds`; then one call tries the store (the others
    still fail at once) and its outcome closes or reopens the breaker."""

    LOG_EVERY = 60.0

    def __init__(
        self,
        store: Store,
        registry: CollectorRegistry | None = None,
        open_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.open_seconds = open_seconds
        self.clock = clock
        self.failures = Counter(
            metrics.GATEWAY_QUOTA_STORE_FAILURES.removesuffix("_total"),
            "Calls to the quota store that failed (each opens its breaker: quotas fail open).",
            registry=registry,
        )
        self._open_until: float | None = None  # None: closed
        self._probing = False
        self._logged = -math.inf

    async def _call(self, call: Callable[[], Awaitable[int]]) -> int:
        probe = False
        if self._open_until is not None:
            if self._probing or self.clock() < self._open_until:
                raise StoreUnavailable("the quota store's breaker is open")
            self._probing = probe = True
        try:
            value = await call()
        except Exception as error:
            self._failed(error)
            raise StoreUnavailable(str(error)) from error
        finally:
            if probe:
                self._probing = False
        if self._open_until is not None:
            log.warning("quota store answers again: quotas are checked again")
            self._open_until = None
        return value

    def _failed(self, error: Exception) -> None:
        self.failures.inc()
        now = self.clock()
        self._open_until = now + self.open_seconds
        if now - self._logged >= self.LOG_EVERY:
            self._logged = now
            log.warning(
                "quota store failed (%s: %s); quotas fail open (fallback budgets closed) "
                "and the store is asked again in %g s (counted in %s)",
                type(error).__name__,
                error,
                self.open_seconds,
                metrics.GATEWAY_QUOTA_STORE_FAILURES,
            )

    async def add(self, key: str, amount: int, ttl: int) -> int:
        return await self._call(lambda: self.store.add(key, amount, ttl))

    async def get(self, key: str) -> int:
        return await self._call(lambda: self.store.get(key))

    async def close(self) -> None:
        close = getattr(self.store, "close", None)
        if close is not None:
            await close()


@dataclass
class Reservation:
    """What one request holds in its tenant's counts until it ends (`Limiter.settle`)."""

    tokens: int  # prompt estimate + output bound
    window: int | None = None  # the minute charged in (None: no per-minute quota counted)
    day: int | None = None  # the day its fallback reservation is in (None: none held)

    @property
    def held(self) -> bool:
        """Something is charged in a store (to settle at the end)."""
        return self.window is not None or self.day is not None


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
    """Whether a request reserving `estimate` tokens (prompt + its answer's bound) fits its
    tenant's quotas this minute, given what this minute holds so far."""
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
    """The quota checks of one gateway process over a `Store` (usually a `Breaker`: a
    store that fails, `StoreUnavailable`, fails open for quotas, closed for budgets)."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock

    @staticmethod
    def _keys(tenant: str, index: int) -> tuple[str, str]:
        return f"{tenant}:req:{index}", f"{tenant}:tok:{index}"

    async def admit(
        self, tenant: str, reservation: Reservation, rpm: int | None, tpm: int | None
    ) -> Verdict:
        """Check and charge one request reserving `reservation.tokens`; when its tokens
        are charged, `reservation.window` says where (settle it at its end). Charged first
        and taken back when refused, so gateways sharing a store never admit past the quota
        between a read and a write (a request racing a refused one may see the count high
        for that moment: refused, not over)."""
        now = self.clock()
        index, reset = window(now)
        req_key, tok_key = self._keys(tenant, index)
        ttl = 2 * MINUTE
        reserve = reservation.tokens
        try:
            requests = await self.store.add(req_key, 1, ttl) if rpm is not None else 1
            tokens = await self.store.add(tok_key, reserve, ttl) if tpm is not None else reserve
        except StoreUnavailable:  # fail open: admitted, nothing to settle
            return Verdict(True, rpm, None, tpm, None, reset)
        v = verdict(now, requests - 1, tokens - reserve, reserve, rpm, tpm)
        if not v.allowed:
            try:
                if rpm is not None:
                    await self.store.add(req_key, -1, ttl)
                if tpm is not None and reserve:
                    await self.store.add(tok_key, -reserve, ttl)
            except StoreUnavailable:
                pass
        elif tpm is not None:
            reservation.window = index
        return v

    async def reserve_fallback(self, tenant: str, reservation: Reservation, per_day: int) -> bool:
        """Reserve the request's tokens against the tenant's fallback budget today (UTC):
        False (nothing held) where they do not fit what is left, or the store fails."""
        index, _ = window(self.clock(), DAY)
        key = f"{tenant}:fallback:{index}"
        try:
            if await self.store.add(key, reservation.tokens, 2 * DAY) > per_day:
                await self.store.add(key, -reservation.tokens, 2 * DAY)
                return False
        except StoreUnavailable:
            return False
        reservation.day = index
        return True

    def release_fallback(self, tenant: str, reservation: Reservation) -> Coroutine[Any, Any, None]:
        """The request went to a replica: its fallback reservation goes back."""
        day, reservation.day = reservation.day, None
        return self._settle(tenant, reservation.tokens, None, day, 0)

    def settle(
        self, tenant: str, reservation: Reservation, used: int | None, fallback: bool = False
    ) -> Coroutine[Any, Any, None]:
        """The request ended having been served `used` tokens (None: nothing served, all
        refunded), by the fallback API when `fallback`: its reservations become that."""
        minute, day = reservation.window, reservation.day
        reservation.window = reservation.day = None
        return self._settle(tenant, reservation.tokens, minute, day, used, fallback)

    async def _settle(
        self,
        tenant: str,
        reserved: int,
        minute: int | None,
        day: int | None,
        used: int | None,
        fallback: bool = False,
    ) -> None:
        """A refund goes back to the window the reservation is in; an excess is charged
        to the current one (a window's keys expire with it: a past one takes nothing)."""
        now = self.clock()
        try:
            if minute is not None:
                correction = (used or 0) - reserved
                index = minute if correction < 0 else window(now)[0]
                if correction:
                    await self.store.add(self._keys(tenant, index)[1], correction, 2 * MINUTE)
            if day is not None:
                correction = ((used or 0) if fallback else 0) - reserved
                index = day if correction < 0 else window(now, DAY)[0]
                if correction:
                    await self.store.add(f"{tenant}:fallback:{index}", correction, 2 * DAY)
        except StoreUnavailable:
            pass  # fail open: the breaker logged it
