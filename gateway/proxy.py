"""Forwarding to engines and the fallback API, and relaying their answers.

- `open_upstream` tries the ordered candidates: a connection error or a 5xx
  before the first byte moves on to the next candidate (bounded), and counts
  against the endpoint's outlier record. A 4xx is the client's problem and
  passes through.
- `relay_stream` copies an SSE stream chunk by chunk, timing TTFT and ITL;
  if the engine dies or stalls mid-stream it ends the client's stream with an
  error event at once, never a hang.
- `DisconnectAwareStreamingResponse` stops relaying (and so closes the
  upstream request) as soon as the client disconnects.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import anyio
import httpx
from kubellm.gateway.protocol.errors import sse_error_event
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# A chunk carrying generated text (engines send an empty role chunk before the first token).
_TOKEN = re.compile(rb'"(?:content|text)":\s*"[^"]')

FORWARDED_HEADERS = ("content-type", "accept", "x-request-id", "openai-organization")


@functools.lru_cache(maxsize=4096)
def _url(url: str) -> httpx.URL:
    """Parsed upstream URLs, cached: httpx's URL parsing is a large share of proxy CPU."""
    return httpx.URL(url)


@dataclass
class Attempt:
    """One upstream that answered without a 5xx, and the release for its in-flight slot."""

    url: str
    response: httpx.Response
    release: Callable[[], None]
    failures: list[str] = field(default_factory=list)


class AllUpstreamsFailed(Exception):
    def __init__(self, failures: list[str]) -> None:
        super().__init__("; ".join(failures) or "no upstream available")
        self.failures = failures


async def open_upstream(
    client: httpx.AsyncClient,
    targets: Sequence[tuple[str, str]],
    body: bytes,
    headers: dict[str, str],
    acquire: Callable[[str], Callable[[], None]],
    on_failure: Callable[[str], None],
    on_success: Callable[[str], None],
    attempts: int,
) -> Attempt:
    """Send to `targets` ((endpoint key, full URL) best first) until one answers below 500."""
    failures: list[str] = []
    for key, url in list(targets)[: max(1, attempts)]:
        release = acquire(key)
        try:
            request = client.build_request("POST", _url(url), content=body, headers=headers)
            response = await client.send(request, stream=True)
        except httpx.HTTPError as error:
            release()
            on_failure(key)
            failures.append(f"{key}: {type(error).__name__}")
            continue
        except BaseException:
            release()
            raise
        if response.status_code >= 500:
            await response.aclose()
            release()
            on_failure(key)
            failures.append(f"{key}: HTTP {response.status_code}")
            continue
        on_success(key)
        return Attempt(key, response, release, failures)
    raise AllUpstreamsFailed(failures)


@dataclass
class StreamTiming:
    start: float
    first: float | None = None
    last: float | None = None
    chunks: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def mean_itl(self) -> float | None:
        if self.first is None or self.last is None or self.chunks < 2:
            return None
        return (self.last - self.first) / (self.chunks - 1)


def rename_model_in_sse(chunk: bytes, served_name: str) -> bytes:
    """Rewrite `"model"` in each SSE data line (fallback responses carry the API's name)."""
    out = []
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                event = json.loads(line[6:])
                if isinstance(event, dict) and "model" in event:
                    event["model"] = served_name
                    line = b"data: " + json.dumps(event, separators=(",", ":")).encode()
            except ValueError:
                pass
        out.append(line)
    return b"\n".join(out)


async def relay_stream(
    response: httpx.Response,
    timing: StreamTiming,
    transform: Callable[[bytes], bytes] | None = None,
) -> AsyncIterator[bytes]:
    """Yield the upstream body; on a mid-stream failure yield one SSE error event and stop."""
    pending = b""
    try:
        async for chunk in response.aiter_raw():
            if _TOKEN.search(chunk):
                now = time.monotonic()
                if timing.first is None:
                    timing.first = now
                elif timing.last is not None:
                    timing.gaps.append(now - timing.last)
                timing.last = now
                timing.chunks += 1
            if transform is None:
                yield chunk
                continue
            pending += chunk
            complete, sep, pending = pending.rpartition(b"\n\n")
            if sep:
                yield transform(complete + sep)
        if pending:
            yield transform(pending) if transform else pending
    except httpx.HTTPError as error:
        timing.error = f"upstream stream failed: {type(error).__name__}"
        yield sse_error_event(
            "The model replica failed mid-stream; the response is incomplete.",
            "server_error",
            "upstream_stream_error",
        )
    finally:
        await response.aclose()


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client going away.

    Starlette only notices a disconnect when a send fails; a slow engine may
    not produce a chunk for a long time, and its request would run on. Here the
    relay is cancelled as soon as `http.disconnect` arrives, which closes the
    upstream connection and so cancels the request at the engine.
    """

    def __init__(self, *args: object, on_close: Callable[[], Awaitable[None]], **kw: object):
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()
