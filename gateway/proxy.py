"""Forwarding to engines and the fallback API, and relaying their answers.

- `open_upstream` tries the ordered candidates: a connection error or a 5xx
  before the first byte moves on to the next candidate (bounded), and counts
  against the endpoint's outlier record. A 4xx is the client's problem and
  passes through.
- `relay_stream` copies an SSE stream chunk by chunk, timing TTFT and ITL;
  if the engine dies or stalls mid-stream it ends the client's stream with an
  error event at once, never a hang.
- `relay` sends a stream to the client as raw ASGI messages, one per upstream
  HTTP chunk, with the same timing and the same error event.
- `DisconnectWatch` cancels the request's work (and so closes the upstream
  request) as soon as the client disconnects, mid-stream included.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from kubellm.gateway import upstream
from kubellm.gateway.protocol.errors import sse_error_event
from starlette.types import Receive, Send

# A chunk carrying generated text (engines send an empty role chunk before the first token).
_TOKEN = re.compile(rb'"(?:content|text)":\s*"[^"]')

FORWARDED_HEADERS = ("content-type", "accept", "x-request-id", "openai-organization")

# What an upstream failing looks like: refused or reset connections, timeouts (connect,
# or `read_timeout` of silence), a body cut short; from aiohttp (the fallback API) or
# from `upstream` (the replicas).
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientError,
    upstream.UpstreamError,
    TimeoutError,
)

# An answer being relayed: from a replica (`upstream`) or from the fallback API (aiohttp).
AnyResponse = upstream.Response | aiohttp.ClientResponse


def new_session(connect_timeout: float, read_timeout: float) -> aiohttp.ClientSession:
    """The gateway's upstream client: keep-alive connections, no pool cap.

    `read_timeout` bounds each silence (between reads, mid-stream included), not the
    whole answer. Created inside the running event loop. Nothing is added to what the
    client sent: no content type is made up for a body that came without one.
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60),
        timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        ),
        skip_auto_headers=("Content-Type",),
    )


def close_response(response: AnyResponse) -> None:
    """Release a fully read answer's connection for reuse; close any other (so the engine
    sees the request end: a client that left, a stream that broke)."""
    if isinstance(response, upstream.Response):
        response.close()
    elif response.content.is_eof():
        response.release()
    else:
        response.close()


async def http_chunks(response: AnyResponse) -> AsyncIterator[bytes]:
    """The body as the engine framed it: one item per HTTP chunk (an SSE event, usually),
    not whatever happened to be buffered, so each event is timed and relayed on its own."""
    if isinstance(response, upstream.Response):
        while data := await response.readchunk():
            yield data
        return
    async for data, _ in response.content.iter_chunks():
        if data:
            yield data


@dataclass
class Attempt:
    """One upstream that answered without a 5xx, and the release for its in-flight slot."""

    url: str
    response: AnyResponse
    release: Callable[[], None]
    failures: list[str] = field(default_factory=list)


class AllUpstreamsFailed(Exception):
    def __init__(self, failures: list[str]) -> None:
        super().__init__("; ".join(failures) or "no upstream available")
        self.failures = failures


async def open_upstream(
    client: upstream.Pool,
    targets: Sequence[tuple[str, str]],
    body: bytes,
    headers: dict[str, str],
    acquire: Callable[[str], Callable[[], None]],
    on_failure: Callable[[str], None],
    on_success: Callable[[str], None],
    attempts: int,
    session: aiohttp.ClientSession | None = None,
) -> Attempt:
    """Send to `targets` ((endpoint key, full URL) best first) until one answers below 500.

    Plain http:// URLs go through `client`; any other (https) through `session`."""
    failures: list[str] = []
    for key, url in list(targets)[: max(1, attempts)]:
        release = acquire(key)
        try:
            response: AnyResponse
            if url.startswith("http://") or session is None:
                response = await client.post(url, body, headers)
            else:
                response = await session.post(url, data=body, headers=headers)
        except UPSTREAM_ERRORS as error:
            release()
            on_failure(key)
            failures.append(f"{key}: {type(error).__name__}")
            continue
        except BaseException:
            release()
            raise
        if response.status >= 500:
            response.close()
            release()
            on_failure(key)
            failures.append(f"{key}: HTTP {response.status}")
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

    def token(self, now: float) -> None:
        """A chunk carrying generated text arrived at `now`."""
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now
        self.chunks += 1

    def failed(self, error: BaseException) -> bytes:
        """The upstream broke mid-stream: note it; the SSE error event that ends the stream."""
        self.error = f"upstream stream failed: {type(error).__name__}"
        return _MID_STREAM_ERROR

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def mean_itl(self) -> float | None:
        if self.first is None or self.last is None or self.chunks < 2:
            return None
        return (self.last - self.first) / (self.chunks - 1)


_MID_STREAM_ERROR = sse_error_event(
    "The model replica failed mid-stream; the response is incomplete.",
    "server_error",
    "upstream_stream_error",
)


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
    chunks: AsyncIterator[bytes],
    timing: StreamTiming,
    transform: Callable[[bytes], bytes] | None = None,
) -> AsyncIterator[bytes]:
    """Yield the upstream body (`chunks`: as they arrive); on a mid-stream failure yield
    one SSE error event and stop. The caller closes the upstream response."""
    pending = b""
    search = _TOKEN.search
    try:
        async for chunk in chunks:
            if search(chunk):
                timing.token(time.monotonic())
            if transform is None:
                yield chunk
                continue
            pending += chunk
            complete, sep, pending = pending.rpartition(b"\n\n")
            if sep:
                yield transform(complete + sep)
        if pending:
            yield transform(pending) if transform else pending
    except UPSTREAM_ERRORS as error:
        yield timing.failed(error)


async def relay(
    response: AnyResponse,
    send: Send,
    timing: StreamTiming,
    rename: str | None = None,
) -> None:
    """Send the upstream body to the client as ASGI body messages, one per HTTP chunk as
    it arrives, then end the response; what `relay_stream` yields, without its layers of
    async generators on the path of every chunk. `rename`: the served name to put in the
    events' `model` (fallback answers). The caller sends the status line and closes the
    upstream response."""
    if isinstance(response, upstream.Response) and rename is None:
        read = response.readchunk
        search = _TOKEN.search
        monotonic = time.monotonic
        while True:
            try:
                data = await read()
            except UPSTREAM_ERRORS as error:
                data = timing.failed(error)
                await send({"type": "http.response.body", "body": data, "more_body": True})
                break
            if not data:
                break  # the end of the body
            if search(data):
                timing.token(monotonic())
            await send({"type": "http.response.body", "body": data, "more_body": True})
    elif rename is not None:
        transform = lambda chunk: rename_model_in_sse(chunk, rename)  # noqa: E731
        async for chunk in relay_stream(http_chunks(response), timing, transform):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    else:
        readchunk = response.content.readchunk
        search = _TOKEN.search
        monotonic = time.monotonic
        while True:
            try:
                data, end_of_chunk = await readchunk()
            except UPSTREAM_ERRORS as error:
                data = timing.failed(error)
                await send({"type": "http.response.body", "body": data, "more_body": True})
                break
            if not data:
                if end_of_chunk:
                    continue
                break  # the end of the body
            if search(data):
                timing.token(monotonic())
            await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class DisconnectWatch:
    """Cancel the current task when the client disconnects, in one watcher task.

    Use as `async with DisconnectWatch(receive) as watch:`; when the watcher
    cancelled the task, the CancelledError is turned into `watch.disconnected`
    being True (and the task's cancel request withdrawn), any other cancellation
    propagates. Cheaper than running the work in a second task and waiting on both.
    Leaving the block drops the references between the watch and the two tasks,
    so that nothing of a finished request waits for the cyclic garbage collector.
    """

    __slots__ = ("_receive", "_running", "_task", "_watcher", "disconnected")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._running = True
        self.disconnected = False

    async def __aenter__(self) -> DisconnectWatch:
        task = asyncio.current_task()
        assert task is not None
        self._task: asyncio.Task[object] | None = task
        self._watcher: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(
            self._watch()
        )
        return self

    async def _watch(self) -> None:
        receive = self._receive
        while (await receive())["type"] != "http.disconnect":
            pass
        if self._running and self._task is not None:
            self.disconnected = True
            self._task.cancel()

    async def __aexit__(self, kind: object, error: object, tb: object) -> bool:
        self._running = False
        task, watcher = self._task, self._watcher
        self._task = self._watcher = None
        assert task is not None and watcher is not None
        watcher.cancel()
        if kind is asyncio.CancelledError and self.disconnected:
            task.uncancel()  # our own cancel, delivered: the task goes on
            return True
        return False
