"""The prefill leg of a split request in Inference Extension mode (P/D, issue 41).

The picker runs the leg itself before it answers Envoy, rather than llm-d's sidecar on the
decode pod reading `x-prefiller-host-port`: the picker already holds the whole body (it
routes on it), so it can send the prefill leg, then hand Envoy the decode leg's body (the
client's request carrying the returned `kv_transfer_params`) with the decode replica as the
destination. No sidecar to deploy, version or secure beside every decode pod, and the
decision, the fallback to local prefill and the metrics are the HTTP gateway's
(`routing/disagg.prefill_leg`). The cost: the picker's stream waits for the prefill (the
TTFT the client would wait anyway). The decode leg's body replaces the client's in both
request body modes the picker serves: in pieces (full-duplex streamed) or whole (a body
mutation of the buffered body, the bootstrap's default).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import aiohttp
from kubellm.gateway.protocol.kv_transfer import decode_body
from kubellm.gateway.routing.disagg import DisaggMetrics, prefill_leg

if TYPE_CHECKING:
    from kubellm.gateway.routing.lifecycle import Ticket
    from kubellm.gateway.routing.scheduler import Scheduler

__all__ = ["MAX_PREFILL_ANSWER", "split"]

MAX_PREFILL_ANSWER = 4 * 1024 * 1024  # one token and the KV params: far less


async def split(
    scheduler: Scheduler,
    disagg: DisaggMetrics,
    client: aiohttp.ClientSession,
    ticket: Ticket,
    decode_url: str,
    path: str,
    body: dict[str, Any],
    raw: bytes,
) -> bytes:
    """The body Envoy sends the decode replica: `raw` (local prefill) or the decode leg's."""
    decode = next((c for c in ticket.order if c.url == decode_url), None)
    if decode is None:
        return raw

    async def post(url: str, leg: bytes, deadline: float) -> bytes | None:
        timeout = aiohttp.ClientTimeout(total=deadline)
        headers = {"content-type": "application/json"}
        try:
            async with client.post(url, data=leg, headers=headers, timeout=timeout) as response:
                if response.status != 200:
                    return None
                parts, size = [], 0
                async for piece in response.content.iter_any():
                    size += len(piece)
                    if size > MAX_PREFILL_ANSWER:
                        return None
                    parts.append(piece)
                return b"".join(parts)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    params = await prefill_leg(scheduler, disagg, ticket, decode, path, body, post)
    return raw if params is None else decode_body(json.loads(raw), params)
