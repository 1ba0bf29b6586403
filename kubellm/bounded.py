"""One bounded reader for every answer a component scrapes from a peer it does not control.

The gateway (engine `/metrics`, `/v1/models`) and the autoscaler (engine and gateway
`/metrics`, `/v1/models`) read small documents from replicas; a broken or hostile replica
may answer with gigabytes, or trickle bytes forever. `read_capped` takes the body in
chunks and stops at `limit` bytes (a declared `Content-Length` over it is refused before
any byte is read), so memory never holds more than `limit` plus one chunk; callers wrap it
in a deadline for the whole answer (aiohttp's `total` timeout, `asyncio.timeout`).
"""

from __future__ import annotations

from collections.abc import AsyncIterable

# The most a scraped answer may hold: vLLM's /metrics is a few hundred KiB with every
# histogram and adapter label set, /v1/models far less. A replica that sends more is
# broken (or hostile).
MAX_ANSWER_BYTES = 16 * 1024 * 1024


class AnswerTooLarge(ValueError):
    """A peer's answer passed the bound."""


async def read_capped(
    chunks: AsyncIterable[bytes], limit: int = MAX_ANSWER_BYTES, declared: int | None = None
) -> bytes:
    """The whole body of `chunks`, at most `limit` bytes; AnswerTooLarge past it (or when the
    declared length, the answer's Content-Length, is over it)."""
    if declared is not None and declared > limit:
        raise AnswerTooLarge(f"answer of {declared} bytes declared, over the {limit}-byte bound")
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise AnswerTooLarge(f"answer larger than {limit} bytes")
    return bytes(body)
