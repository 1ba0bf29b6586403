"""The prefill leg of a split request through the HTTP front end (P/D, issue 41): the
routing core decides and runs the leg (`routing/disagg.prefill_leg`); this sends it over
the replicas' keep-alive client, and builds the decode leg's body."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kubellm.gateway.http import relay
from kubellm.gateway.http.upstream import Deadlines
from kubellm.gateway.protocol.kv_transfer import decode_body
from kubellm.gateway.routing.disagg import DisaggMetrics, prefill_leg

if TYPE_CHECKING:
    from kubellm.gateway.http import upstream
    from kubellm.gateway.routing.lifecycle import Ticket
    from kubellm.gateway.routing.scheduler import Scheduler

__all__ = ["split"]


async def split(
    scheduler: Scheduler,
    disagg: DisaggMetrics,
    pool: upstream.Pool,
    ticket: Ticket,
    path: str,
    body: dict[str, Any],
    raw: bytes,
    headers: dict[str, str],
    connect_timeout: float,
) -> bytes:
    """The body to send the decode replica: `raw` (local prefill) or the decode leg's."""
    if not ticket.order:
        return raw
    leg_headers = {**headers, "content-type": "application/json"}
    if "x-request-id" in headers:  # engines need unique ids: the decode leg has the given one
        leg_headers["x-request-id"] = headers["x-request-id"] + "-prefill"

    async def post(url: str, leg: bytes, deadline: float) -> bytes | None:
        try:
            response = await pool.post(
                url, leg, leg_headers, Deadlines(deadline, deadline, deadline), connect_timeout
            )
            try:
                return await response.read() if response.status == 200 else None
            finally:
                response.close()
        except (*relay.UPSTREAM_ERRORS, ValueError):  # ValueError: an https replica
            return None

    params = await prefill_leg(scheduler, disagg, ticket, ticket.order[0], path, body, post)
    return raw if params is None else decode_body(json.loads(raw), params)
