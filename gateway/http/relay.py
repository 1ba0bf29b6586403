"""Forwarding to replicas and the fallback API, and relaying their answers to the client.

- `open_upstream` tries the ordered replicas until one gives a usable start: a
  connection error, a 5xx, no first byte within its timeout, or a malformed answer
  before anything reached the client moves on to the next (bounded by `attempts`
  and the request's total budget) and counts against the replica's health; a refused
  connection or a frozen replica is ejected at once. A 4xx is the client's problem
  and passes through. Nothing is sent to the client until a replica gave its first
  body byte (streams, and the non-streamed requests sent as streams) or its whole
  answer (non-streamed), so retries stay invisible.
- `relay` sends a stream to the client as raw ASGI messages, one per upstream HTTP
  chunk, timing TTFT and ITL; if the replica dies, stalls or breaks the framing
  mid-stream, the client's stream ends at once with an SSE error event, never a hang
  and never the bytes that could not be parsed.
- A non-streamed request goes to each replica either whole or as a stream (`Whole`, per
  attempt: by default whole where the replica's token counters are fresh, a stream
  elsewhere; docs/operations.md, "Non-streamed requests"). A stream, or a replica streaming
  anyway, is read to its `[DONE]` and assembled before anything is sent, so a stream that
  breaks, reports an error, outgrows its bounds or stalls is a failed attempt like a 5xx,
  and the next replica is tried. A replica that leaves its response open after `[DONE]` is
  answered at `[DONE]` (its connection closed, never pooled).
- **The first byte** (a whole answer: its end) of a replica whose scraped token counters
  are known is waited for while they move (`ProgressWatch`): a request queued behind
  others in a busy engine is not cut at the first-byte deadline, a frozen engine is left
  once they stood still for the stall time (never before the first-byte deadline). A
  replica without known counters: the first-byte deadline (whole: the total timeout).
- **A stall** between an assembled stream's pieces is a replica silent for
  `stall_seconds`: `STALL_FACTOR` times the 99th percentile of the gaps between the pieces
  of its own recent whole answers (`Pace`; the model's ITL target until
  `PACE_MIN_SAMPLES` gaps were seen), at least `STALL_FLOOR_S`, at most the idle timeout.
  A replica frozen mid-answer is left within seconds, not at the idle timeout (a minute by
  default); a slow replica (long gaps of its own) is given time in proportion.
- `DisconnectWatch` cancels the request's work (and so closes the upstream request)
  as soon as the client disconnects, mid-stream included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import aiohttp
from kubellm.gateway.http import upstream
from kubellm.gateway.http.upstream import Deadlines, UpstreamError
from kubellm.gateway.protocol import assemble
from kubellm.gateway.protocol.assemble import Assembler, AssemblyError
from kubellm.gateway.protocol.errors import sse_error_event
from kubellm.gateway.protocol.headers import first_values
from kubellm.gateway.protocol.openai import CHAT
from kubellm.gateway.routing.lifecycle import Ticket
from starlette.types import Receive, Send

FORWARDED_HEADERS = ("content-type", "accept", "x-request-id", "openai-organization")

# What an upstream failing looks like: refused or reset connections, timeouts, a body cut
# short or malformed; from aiohttp (https replicas, the fallback API) or from `upstream`.
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientError,
    UpstreamError,
    TimeoutError,
)
STALL_FACTOR = 20.0  # a stall: this many times the replica's own p99 gap between pieces
STALL_FLOOR_S = 5.0  # never less (a long prefill batched beside it, a preemption)
PACE_SAMPLES = 256  # gaps kept per replica
PACE_MIN_SAMPLES = 32  # fewer: the model's ITL target stands for the replica's p99
PACE_REPLICAS = 4096  # replicas remembered (the oldest forgotten first)
DONE_GRACE_S = 0.5  # after `[DONE]`, how long the response's end may take to arrive


def stall_seconds(gap_p99: float | None, itl_target: float, idle: float) -> float:
    """How long a replica may be silent mid-answer before it is taken for stalled."""
    basis = itl_target if gap_p99 is None else gap_p99
    return min(idle, max(STALL_FLOOR_S, STALL_FACTOR * basis))


class Pace:
    """Each replica's recent gaps between the pieces of its whole answers, and their 99th
    percentile (recomputed once every `PACE_MIN_SAMPLES` new gaps)."""

    def __init__(self) -> None:
        self._gaps: dict[str, deque[float]] = {}
        self._p99: dict[str, tuple[float, int]] = {}  # url -> (p99, gaps seen since)

    def observe(self, url: str, gaps: list[float]) -> None:
        kept = self._gaps.get(url)
        if kept is None:
            if len(self._gaps) >= PACE_REPLICAS:
                oldest = next(iter(self._gaps))
                del self._gaps[oldest]
                self._p99.pop(oldest, None)
            kept = self._gaps[url] = deque(maxlen=PACE_SAMPLES)
        kept.extend(gaps)
        p99, since = self._p99.get(url, (math.nan, PACE_MIN_SAMPLES))
        since += len(gaps)
        if since >= PACE_MIN_SAMPLES and len(kept) >= PACE_MIN_SAMPLES:
            ordered = sorted(kept)
            p99, since = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 0
        self._p99[url] = (p99, since)

    def p99(self, url: str) -> float | None:
        """The replica's p99 gap, None until enough were seen."""
        found = self._p99.get(url)
        return None if found is None or math.isnan(found[0]) else found[0]


class Progress(NamedTuple):
    """What tells a working replica from a frozen one, per attempt: the gaps between the
    pieces of its recent assembled answers (`pace`, the model's ITL target until known:
    the stall time, `stall_seconds`) and its scraped token counters (`progressed`, for
    `ProgressWatch`)."""

    pace: Pace
    itl_target: float
    progressed: Callable[[str, float], bool | None] | None = None


class Whole:
    """A non-streamed request to replicas. Per attempt, `streams(url)` says whether that
    replica gets it as a stream (`streamed()`: that body); `replicas(url)` says which
    replicas would (None: none), for a request that `protocol.assemble` can assemble at
    all (others always go whole). An answer that comes as a stream (asked as one, or a
    replica streaming anyway) is assembled (`assembler()` makes one per attempt; None:
    relayed as it comes) before anything reaches the client.

    Whether the request can be assembled is worked out only when an attempt asks: most go
    whole to a replica whose counters are watched and never need to know."""

    __slots__ = ("_assembles", "_body", "_max_bytes", "_path", "_raw", "_replicas")

    def __init__(
        self,
        body: dict[str, Any],
        path: str,
        raw: bytes,
        replicas: Callable[[str], bool] | None,
        max_bytes: int,
    ) -> None:
        self._body = body
        self._path = path
        self._raw = raw
        self._replicas = replicas
        self._max_bytes = max_bytes
        self._assembles: bool | None = None

    def assembles(self) -> bool:
        """The request can be sent as a stream and its answer assembled (`assemble`)."""
        if self._assembles is None:
            self._assembles = assemble.assembles(self._body, self._path)
        return self._assembles

    def streams(self, url: str) -> bool:
        return self._replicas is not None and self._replicas(url) and self.assembles()

    def streamed(self) -> bytes:
        return assemble.streamed_body(self._body, self._raw)

    def assembler(self) -> Assembler | None:
        if not self.assembles():
            return None
        choices = assemble.choices_of(self._body, self._path)
        return Assembler(self._path == CHAT, self._max_bytes, choices)


def always(url: str) -> bool:
    """`Whole.streams` for `--assemble-non-streamed`: every replica gets a stream."""
    return True


class ProgressWatch:
    """Until a replica's first byte (a non-streamed request forwarded whole: its whole
    answer) nothing of the request shows, and a request queued in a busy engine may wait
    long for it. So a replica whose token counters are known is waited for as long as they
    move (`vllm:prompt_tokens_total` + `vllm:generation_tokens_total`, scraped each second:
    `progressed(url, since)`: the engine works through its queue), and taken for stalled
    once they stood still for `stall` seconds, checked from `first` on (the first-byte
    deadline: never sooner) every `stall / 2`: the attempt's task is cancelled and
    `ReadTimeout` raised, a failed attempt like a stall mid-stream. A replica whose
    counters are not known gets no watch (`open_upstream`: the first-byte deadline).

        with ProgressWatch(progressed, url, stall):
            ... await the answer ..."""

    __slots__ = ("_first", "_handle", "_progressed", "_stall", "_task", "_url", "stalled")

    def __init__(
        self,
        progressed: Callable[[str, float], bool | None],
        url: str,
        stall: float,
        first: float | None = None,
    ) -> None:
        self._progressed = progressed
        self._url = url
        self._stall = stall
        self._first = stall if first is None else first
        self.stalled = False

    def __enter__(self) -> ProgressWatch:
        self._task = asyncio.current_task()
        self._handle = asyncio.get_running_loop().call_later(self._first, self._check)
        return self

    def _check(self) -> None:
        if self._progressed(self._url, time.monotonic() - self._stall) is False:
            self.stalled = True
            assert self._task is not None
            self._task.cancel()
        else:
            self._handle = asyncio.get_running_loop().call_later(self._stall / 2, self._check)

    def __exit__(self, kind: object, error: object, tb: object) -> None:
        self._handle.cancel()
        self._task = None
        if kind is asyncio.CancelledError and self.stalled:
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # our own cancel
            raise upstream.ReadTimeout("progress on the replica's token counters", self._stall)


def new_session(connect_timeout: float, read_timeout: float) -> aiohttp.ClientSession:
    """The client for https replicas, the fallback API and scraping: keep-alive, no pool
    cap, no redirects followed, nothing added to what the client sent.

    `read_timeout` bounds each silence (between reads, mid-stream included). Created
    inside the running event loop."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60),
        timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        ),
        skip_auto_headers=("Content-Type",),
        max_line_size=8190,
        max_field_size=8190,
    )


class AiohttpResponse:
    """An aiohttp answer with the shape of `upstream.Response` (`readchunk`, `read`,
    `close`), so one relay serves both clients. `read` is bounded like the pool's."""

    __slots__ = ("_limit", "_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse, limit: int) -> None:
        self._response = response
        self._limit = limit
        self.status = response.status
        self.headers = first_values((k.lower(), v) for k, v in response.headers.items())

    async def readchunk(self) -> bytes:
        while True:
            data, end_of_chunk = await self._response.content.readchunk()
            if data or not end_of_chunk:
                return data

    readsome = readchunk

    def ended(self) -> bool:
        """The body was read to its end."""
        return self._response.content.is_eof()

    async def read(self) -> bytes:
        parts, size = [], 0
        while data := await self.readchunk():
            size += len(data)
            if size > self._limit:
                self.close()
                raise UpstreamError(f"answer exceeds the limit of {self._limit} bytes")
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Release a fully read answer's connection for reuse; close any other."""
        if self._response.content.is_eof():
            self._response.release()
        else:
            self._response.close()


AnyResponse = upstream.Response | AiohttpResponse


class Forward(NamedTuple):
    """One request to forward: what to send, where, and how long each stage may take.
    (`Forward` and `Progress` are tuples: every request builds them, and a frozen
    dataclass costs three times as much to build.)"""

    path: str  # appended to each replica's base URL
    body: bytes
    headers: dict[str, str]
    stream: bool  # the client's stream (False: `whole` says how each attempt goes)
    deadlines: Deadlines  # a stream's (an attempt forwarded whole: first byte = total)
    connect_timeout: float
    attempts: int
    whole: Whole | None = None  # a non-streamed request (`Whole`)
    progress: Progress | None = None  # stalls and the first byte's wait (`open_upstream`)


@dataclass
class Opened:
    """The replica that answered: its response and what was read of it (its in-flight
    slot is the ticket's). `first` is the first body piece of a stream; `body` the whole
    answer when not streamed (None while streaming); `assembled`: `body` is the JSON
    assembled from the replica's stream (`Whole`)."""

    url: str
    response: AnyResponse
    first: bytes = b""
    body: bytes | None = None
    failures: list[str] = field(default_factory=list)
    assembled: bool = False


class AllUpstreamsFailed(Exception):
    def __init__(self, failures: list[str]) -> None:
        super().__init__("; ".join(failures) or "no upstream available")
        self.failures = failures


async def _post(
    forward: Forward,
    url: str,
    body: bytes,
    deadlines: Deadlines,
    pool: upstream.Pool,
    session: aiohttp.ClientSession | None,
) -> AnyResponse:
    if url.startswith("http://") or session is None:
        return await pool.post(
            url + forward.path, body, forward.headers, deadlines, forward.connect_timeout
        )
    timeout = aiohttp.ClientTimeout(
        total=None if math.isinf(deadlines.total) else deadlines.total,
        sock_connect=forward.connect_timeout,
        sock_read=max(deadlines.first_byte, deadlines.idle),
    )
    response = await session.post(
        url + forward.path,
        data=body,
        headers=forward.headers,
        timeout=timeout,
        allow_redirects=False,
    )
    return AiohttpResponse(response, pool.limits.max_body_bytes)


async def open_upstream(
    forward: Forward,
    ticket: Ticket,
    pool: upstream.Pool,
    session: aiohttp.ClientSession | None = None,
) -> Opened:
    """Send `forward` to the ticket's replicas (best first) until one gives a usable
    start; see the module. Each try is a `ticket.attempt`, failed or started."""
    failures: list[str] = []
    start = time.monotonic()
    budget = forward.deadlines
    whole, progress = forward.whole, forward.progress
    for url in ticket.urls()[: max(1, forward.attempts)]:
        left = budget.total - (time.monotonic() - start)
        if left <= 0:
            failures.append("the request's total timeout passed")
            break
        body, first_byte, idle, watch = forward.body, budget.first_byte, budget.idle, None
        whole_body = whole is not None
        if whole is not None and whole.streams(url):
            body, whole_body = whole.streamed(), False  # a stream, assembled
        if progress is not None:
            stall = stall_seconds(progress.pace.p99(url), progress.itl_target, idle)
            if whole is not None:  # between the pieces of an answer assembled
                idle = stall
            progressed = progress.progressed
            if progressed is not None and progressed(url, 0.0) is not None:  # counted
                # queued in the engine or computing, as long as its counters move
                watch = ProgressWatch(progressed, url, stall, max(first_byte, stall))
                first_byte = left
        if whole_body:  # forwarded whole: its first byte is its end
            first_byte = left
        deadlines = Deadlines(min(first_byte, left), idle, left)
        attempt = ticket.attempt(url)
        response: AnyResponse | None = None
        try:
            with watch or contextlib.nullcontext():
                response = await _post(forward, url, body, deadlines, pool, session)
                if response.status >= 500:
                    attempt.failed()
                    failures.append(f"{url}: HTTP {response.status}")
                    response.close()
                    continue
                opened = await _opened(forward, url, response, ticket)
        except (*UPSTREAM_ERRORS, AssemblyError) as error:
            fatal = isinstance(
                error, upstream.ConnectFailed | upstream.ReadTimeout | aiohttp.ClientConnectorError
            )
            attempt.failed(fatal=fatal)
            failures.append(f"{url}: {error}")
            if response is not None:
                response.close()
            continue
        except BaseException:
            if response is not None:
                response.close()
            attempt.abandon()
            raise
        attempt.started()
        opened.failures = failures
        return opened
    raise AllUpstreamsFailed(failures)


async def _opened(forward: Forward, url: str, response: AnyResponse, ticket: Ticket) -> Opened:
    """What was read of a replica's usable answer: a stream's first piece, a whole answer,
    or a non-streamed request's stream assembled (`Whole`)."""
    whole = forward.whole
    if response.status != 200 or (whole is None and not forward.stream):
        return Opened(url, response, body=await response.read())
    if whole is None:
        return Opened(url, response, first=await response.readchunk())
    event_stream = response.headers.get("content-type", "").startswith("text/event-stream")
    assembler = whole.assembler() if event_stream else None
    if assembler is not None:
        pace = forward.progress.pace if forward.progress is not None else None
        body = await _assembled(response, await response.readsome(), assembler, pace, url, ticket)
        return Opened(url, response, body=body, assembled=True)
    return Opened(url, response, body=await response.read())  # whole, as asked or not


MID_STREAM_ERROR = sse_error_event(
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


async def relay(
    response: AnyResponse,
    first: bytes,
    send: Send,
    ticket: Ticket,
    rename: str | None = None,
) -> str | None:
    """Send the upstream body to the client as ASGI body messages, one per HTTP chunk as
    it arrives (`first`: the piece already read), each passed to `ticket.chunk`, then end
    the response. `rename`: the served name to put in the events' `model` (fallback
    answers). Returns why the upstream broke mid-stream, or None. The caller sends the
    status line and closes the upstream response."""
    read = response.readchunk
    chunk = ticket.chunk
    monotonic = time.monotonic
    pending = b""
    data = first
    broken: str | None = None
    while data:
        chunk(data, monotonic())
        if rename is not None:  # whole events only: an event may span chunks
            pending += data
            complete, sep, pending = pending.rpartition(b"\n\n")
            data = rename_model_in_sse(complete + sep, rename) if sep else b""
        if data:
            await send({"type": "http.response.body", "body": data, "more_body": True})
        try:
            data = await read()
        except UPSTREAM_ERRORS as error:
            broken = f"upstream stream failed: {type(error).__name__}"
            pending = b""  # an incomplete event is dropped, never half-sent
            await send({"type": "http.response.body", "body": MID_STREAM_ERROR, "more_body": True})
            break
    if pending:
        tail = rename_model_in_sse(pending, rename) if rename else pending
        await send({"type": "http.response.body", "body": tail, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return broken


async def _assembled(
    response: AnyResponse,
    first: bytes,
    assembler: Assembler,
    pace: Pace | None,
    url: str,
    ticket: Ticket,
) -> bytes:
    """Read a replica's stream to its `[DONE]` (`first`: the piece already read) into
    `assembler`, the gaps between pieces into `pace`; the answer's JSON. Raises what
    the reads or the assembler raise. After `[DONE]` the response's end is awaited for
    `DONE_GRACE_S` at most (so the connection can be pooled), then the caller's close
    closes it. A client that leaves meanwhile was served what came (`ticket.generated`)."""
    try:
        return await _assemble(response, first, pace, url, assembler)
    except asyncio.CancelledError:  # the client left: what came was served
        ticket.generated(assembler.events)
        raise


async def _assemble(
    response: AnyResponse, first: bytes, pace: Pace | None, url: str, assembler: Assembler
) -> bytes:
    """`_assembled`'s reading loop."""
    read = response.readsome
    monotonic = time.monotonic
    gaps: list[float] = []
    last = monotonic()
    data = first
    while data:
        assembler.feed(data)
        if assembler.done:
            if not response.ended():
                with contextlib.suppress(*UPSTREAM_ERRORS):
                    async with asyncio.timeout(DONE_GRACE_S):
                        while await read():
                            pass
            break
        data = await read()
        now = monotonic()
        gaps.append(now - last)
        last = now
    content = assembler.answer()
    if pace is not None:
        pace.observe(url, gaps)
    return content


class DisconnectWatch:
    """Cancel the current task when the client disconnects.

    Use as `async with DisconnectWatch(receive, lost) as watch:`; when the watch
    cancelled the task, the CancelledError is turned into `watch.disconnected`
    being True (and the task's cancel request withdrawn), any other cancellation
    propagates. `lost`: the connection's end as the gateway's server reports it
    (`server.ConnectionLost`, a callback: no task per request); None (another
    server) has one watcher task wait on `receive` for `http.disconnect`. Either is
    cheaper than running the work in a second task and waiting on both.
    Leaving the block drops the references between the watch and the tasks,
    so that nothing of a finished request waits for the cyclic garbage collector.
    """

    __slots__ = ("_lost", "_receive", "_running", "_task", "_watcher", "disconnected")

    def __init__(self, receive: Receive, lost: ConnectionEnd | None = None) -> None:
        self._receive = receive
        self._lost = lost
        self._running = True
        self.disconnected = False

    async def __aenter__(self) -> DisconnectWatch:
        task = asyncio.current_task()
        assert task is not None
        self._task: asyncio.Task[object] | None = task
        self._watcher: asyncio.Task[None] | None = None
        if self._lost is not None:
            self._lost.watch(self._left)
        else:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def _watch(self) -> None:
        receive = self._receive
        while (await receive())["type"] != "http.disconnect":
            pass
        self._left()

    def _left(self) -> None:
        if self._running and self._task is not None:
            self.disconnected = True
            self._task.cancel()

    async def __aexit__(self, kind: object, error: object, tb: object) -> bool:
        self._running = False
        task, watcher = self._task, self._watcher
        self._task = self._watcher = None
        assert task is not None
        if watcher is not None:
            watcher.cancel()
        if self._lost is not None:
            self._lost.unwatch(self._left)
            self._lost = None
        if kind is asyncio.CancelledError and self.disconnected:
            task.uncancel()  # our own cancel, delivered: the task goes on
            return True
        return False


class ConnectionEnd(Protocol):
    """What `DisconnectWatch` needs of a server's report of the connection's end
    (`server.ConnectionLost`)."""

    def watch(self, callback: Callable[[], None]) -> None: ...

    def unwatch(self, callback: Callable[[], None]) -> None: ...
