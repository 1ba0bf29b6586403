"""The HTTP front end's settings: the routing core's (`scheduler`, one type for both
front ends) and the knobs that are this front end's own; each default stated here once
(the CLI reads them). docs/operations.md, "Timeouts and limits", says what each bounds
and how to tune it. Light to import: no server or client library."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kubellm.gateway.routing.settings import SchedulerSettings

if TYPE_CHECKING:
    from kubellm.gateway.discovery.base import ModelTarget
    from kubellm.gateway.http.upstream import Limits


class Deadlines(NamedTuple):
    """Seconds per stage of one upstream response (math.inf: none), `http.upstream`'s.
    (A tuple: every attempt builds one, and a frozen dataclass costs three times as much.)"""

    first_byte: float = 300.0  # from the request written to the first body byte
    idle: float = 300.0  # the longest silence between pieces after the first
    total: float = math.inf  # the whole response, from the request written


@dataclass
class GatewaySettings:
    """Knobs of the HTTP front end (per-model settings come from discovery)."""

    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    max_body_bytes: int = 8 * 1024 * 1024
    api_key_hashes: frozenset[str] = frozenset()  # sha256 hex; empty: no authentication
    attempts: int = 3  # replicas tried before the first byte
    # Toward replicas and the fallback API; a model's spec.routing.timeouts overrides each.
    connect_timeout: float = 2.0
    first_byte_timeout: float | None = None  # None: 5 x the model's TTFT target, >= 10 s
    idle_timeout: float = 60.0  # the longest silence between two chunks of a stream
    total_timeout: float = 600.0  # the whole request, retries included
    # What an upstream answer may be.
    max_upstream_head_bytes: int = 64 * 1024
    max_upstream_headers: int = 100
    max_response_bytes: int = 32 * 1024 * 1024  # a non-streamed answer, held or assembled
    # How non-streamed requests go to replicas. None (the default): whole to a replica
    # whose scraped token counters are fresh (a frozen one found by them standing still,
    # `relay.ProgressWatch`), as a stream assembled here to any other (a stall found between
    # the stream's pieces), so no replica is held to `totalSeconds`. True: as streams to
    # every replica (~1.45x the instructions). False: whole to every replica (one without
    # the counters bounded by the total timeout only). docs/operations.md says more.
    assemble_non_streamed: bool | None = None
    # From clients (header timeout, keep-alive and the connection cap: `http.server`).
    body_timeout: float = 30.0  # reading a request body, from its headers to its end

    def limits(self) -> Limits:
        from kubellm.gateway.http.upstream import Limits

        return Limits(
            self.max_upstream_head_bytes, self.max_upstream_headers, self.max_response_bytes
        )

    def timeouts(self, target: ModelTarget, stream: bool) -> tuple[float, Deadlines]:
        """The connect timeout and stage deadlines for one request to `target`."""
        t = target.routing.timeouts
        total = t.total_seconds or self.total_timeout
        first = (
            t.first_byte_seconds
            or self.first_byte_timeout
            or max(10.0, 5 * target.slo.ttft_seconds)
        )
        if not stream:  # an answer read whole (the requests `protocol.assemble` keeps
            first = total  # non-streamed): its first byte is its end
        idle = t.idle_seconds or self.idle_timeout
        return t.connect_seconds or self.connect_timeout, Deadlines(first, idle, total)


@dataclass(frozen=True)
class ClientLimits:
    """What a client connection may hold (docs/operations.md, "Timeouts and limits");
    `http.server` applies them."""

    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 0  # 0: `default_max_connections()`
    max_head_bytes: int = 64 * 1024  # a request's line and headers (llhttp's incomplete event)
