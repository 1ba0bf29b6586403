"""The prefill leg of a split request (P/D disaggregation, issue 41), HTTP front end.

After admission picked the decode replica (the ticket's first; tenancy, quotas and flow
control counted the request once, there), `split` asks the pure decision
(`routing/disagg.plan`) whether to compute the prompt on a prefill replica. If so it
sends the prefill leg (`protocol/kv_transfer.prefill_body`) there, bounded by a deadline,
and answers the decode leg's body carrying the returned `kv_transfer_params`; the decode
leg then goes through the ordinary attempts (`relay.open_upstream`). A prefill leg that
fails (connect error, 5xx, a body that is not params), stalls or passes its deadline
leaves the body as the client sent it: the decode replica computes the prompt itself
(local prefill), and the client sees one answer either way.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kubellm.gateway.http import relay
from kubellm.gateway.http.upstream import Deadlines
from kubellm.gateway.protocol.kv_transfer import decode_body, kv_params_of, prefill_body
from kubellm.gateway.routing.disagg import DisaggMetrics, plan
from kubellm.gateway.routing.lifecycle import labels
from kubellm.gateway.routing.predicted import CHARS_PER_TOKEN

if TYPE_CHECKING:
    from kubellm.gateway.http import upstream
    from kubellm.gateway.routing.lifecycle import Ticket
    from kubellm.gateway.routing.scheduler import Scheduler

__all__ = ["PREFILL_DEADLINE_FACTOR", "split"]

# The prefill leg may take this many times its predicted split TTFT (at least the TTFT
# target) before the request falls back to local prefill: past it the prediction was
# wrong by more than the model's worst error, and the decode replica is a sure answer.
PREFILL_DEADLINE_FACTOR = 3.0


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
    target = ticket.target
    settings = target.prefill
    if settings is None or not ticket.order:
        return raw
    prefills = scheduler.router.candidates(target, target.prefill_endpoints)
    slo = target.slo
    verdict, url = plan(
        scheduler.predictions, ticket.routing, ticket.order[0], prefills, settings,
        slo.ttft_seconds, slo.itl_seconds,
    )  # fmt: skip
    names = labels(target)
    disagg.decided(names, verdict)
    if url is None:
        return raw
    candidate = next(c for c in prefills if c.url == url)
    deadline = max(slo.ttft_seconds, PREFILL_DEADLINE_FACTOR * verdict.split_ttft)
    start = time.monotonic()
    release = scheduler.load.acquire(url)
    dispatch = scheduler.predictions.sent(url, ticket.routing, candidate)
    params = None
    try:
        async with asyncio.timeout(deadline):
            params = await _prefill(pool, url + path, prefill_body(body), headers, deadline,
                                    connect_timeout)  # fmt: skip
    except (*relay.UPSTREAM_ERRORS, TimeoutError, ValueError):  # ValueError: an https replica
        params = None
    finally:
        release()
        scheduler.predictions.abandoned(url, dispatch)
    if params is None:
        scheduler.failed(url)
        disagg.legs.labels(*names, "prefill", "failed").inc()
        return raw
    scheduler.succeeded(url)
    disagg.legs.labels(*names, "prefill", "ok").inc()
    disagg.prefill.labels(*names).observe(time.monotonic() - start)
    # the decode replica computes none of the prompt: predicted and learnt as cached
    ticket.routing = replace(ticket.routing, prompt_chars=CHARS_PER_TOKEN)
    return decode_body(json.loads(raw), params)


async def _prefill(
    pool: upstream.Pool,
    url: str,
    body: bytes,
    headers: dict[str, str],
    deadline: float,
    connect_timeout: float,
) -> dict[str, Any] | None:
    """The prefill engine's `kv_transfer_params`, or None (an error status, not params)."""
    leg_headers = {**headers, "content-type": "application/json"}
    if "x-request-id" in headers:  # engines need unique ids: the decode leg has the given one
        leg_headers["x-request-id"] = headers["x-request-id"] + "-prefill"
    response = await pool.post(
        url, body, leg_headers, Deadlines(deadline, deadline, deadline), connect_timeout
    )
    try:
        if response.status != 200:
            return None
        return kv_params_of(await response.read())
    finally:
        response.close()
