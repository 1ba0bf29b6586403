"""Send a workload to an OpenAI-compatible endpoint and time every streamed chunk.

I/O lives here: an HTTP client (aiohttp when installed, else httpx) streams each
request (SSE) into a timer that stamps every text chunk, a scheduler starts
conversations on an arrival schedule (Poisson or gamma inter-arrival times, or
a trace's timestamps) and/or under a concurrency cap, and every run is bounded
by its request count and, optionally, a duration.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kubellm.bench.stats import RequestResult
from kubellm.bench.workloads import Conversation, Turn


@dataclass(frozen=True)
class Target:
    url: str  # base URL, with or without /v1
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    timeout_s: float = 300.0

    def endpoint(self, chat: bool) -> str:
        base = self.url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        return base + ("/chat/completions" if chat else "/completions")


@dataclass(frozen=True)
class Schedule:
    rate: float = math.inf  # conversations started per second; inf = all at once
    burstiness: float = 1.0  # gamma shape: 1 = Poisson, <1 burstier, >1 more regular
    concurrency: int | None = None  # cap on conversations in flight
    duration_s: float | None = None  # stop starting work after this long
    use_timestamps: bool = False  # trace replay: start each conversation at its `at`
    seed: int = 0


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send offsets (s) of `n` arrivals: gamma inter-arrival times with mean 1/rate.

    Shape `burstiness` and scale 1/(rate * burstiness), as vLLM's benchmark does;
    burstiness 1 is a Poisson process. Like vLLM, the offsets are then rescaled
    so the last one falls at exactly n / rate: the run offers the asked rate on
    average, whatever the seed, and throughput figures stop depending on luck.
    """
    if burstiness <= 0:
        raise ValueError("--burstiness: must be positive")
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("--rate: must be positive")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    scale = (n / rate) / t if t > 0 else 1.0
    return [x * scale for x in out]


def _error_message(status: int, body: bytes, retry_after: str | None = None) -> str:
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = body[:200].decode(errors="replace")
    wait = f" (Retry-After: {retry_after})" if retry_after else ""
    return f"HTTP {status}: {message}{wait}"


class _StreamTimer:
    """Parses an SSE byte stream and stamps each text chunk as it arrives."""

    def __init__(self, chat: bool, prompt_tokens: int) -> None:
        self.chat = chat
        self.result = RequestResult(ok=False, prompt_tokens=prompt_tokens)
        self.pieces: list[str] = []
        self.chunks = 0
        self.usage_tokens: int | None = None
        self.start = self.last = time.perf_counter()
        self._buffer = b""

    def feed(self, raw: bytes) -> bool:
        """Take bytes off the wire; False once the stream reported an error."""
        self._buffer += raw
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            event = json.loads(data)
            if isinstance(event.get("error"), dict):
                self.result.error = f"stream error: {event['error'].get('message')}"
                return False
            usage = event.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                self.usage_tokens = int(usage["completion_tokens"])
                if usage.get("prompt_tokens") is not None:
                    self.result.prompt_tokens = int(usage["prompt_tokens"])
            choices = event.get("choices")
            if not choices:
                continue
            choice = choices[0]
            text = choice.get("delta", {}).get("content") if self.chat else choice.get("text")
            if not text:
                continue
            now = time.perf_counter()
            if self.chunks == 0:
                self.result.ttft = now - self.start
            else:
                self.result.itls.append(now - self.last)
            self.last = now
            self.chunks += 1
            self.pieces.append(text)
        return True

    def finish(self) -> tuple[RequestResult, str]:
        result = self.result
        if result.error is None and self.chunks == 0:
            result.error = "no token was streamed"
        if result.error is not None:
            return result, ""
        result.ok = True
        result.e2e = self.last - self.start
        result.output_tokens = self.usage_tokens if self.usage_tokens is not None else self.chunks
        return result, "".join(self.pieces)


async def _post_httpx(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> AsyncIterator[tuple[int, str | None] | bytes]:
    """(status, Retry-After header), then the body's bytes."""
    async with client.stream("POST", url, json=body, headers=headers) as response:
        yield response.status_code, response.headers.get("retry-after")
        async for raw in response.aiter_bytes():
            yield raw


async def _post_aiohttp(
    session: Any, url: str, body: dict[str, Any], headers: dict[str, str]
) -> AsyncIterator[tuple[int, str | None] | bytes]:
    """(status, Retry-After header), then the body's bytes."""
    async with session.post(url, json=body, headers=headers) as response:
        yield response.status, response.headers.get("Retry-After")
        async for raw in response.content.iter_any():
            yield raw


async def send(
    client: Any,
    target: Target,
    turn: Turn,
    history: list[dict[str, str]] | None,
) -> tuple[RequestResult, str]:
    """Stream one request; return its measurements and its generated text.

    `client` is an `httpx.AsyncClient` or an `aiohttp.ClientSession`. Any
    exception while sending or reading fails this request, not the run.
    """
    chat = history is not None
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": turn.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [*(history or []), {"role": "user", "content": turn.prompt}]
    else:
        body["prompt"] = turn.prompt
    if target.ignore_eos:
        body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    post = _post_httpx if isinstance(client, httpx.AsyncClient) else _post_aiohttp
    timer = _StreamTimer(chat, turn.prompt_tokens)
    try:
        stream = post(client, target.endpoint(chat), body, headers)
        try:
            status, retry_after = await anext(stream)  # type: ignore[misc]
            if status != 200:
                rest = b"".join([raw async for raw in stream if isinstance(raw, bytes)])
                timer.result.error = _error_message(int(status), rest, retry_after)
            else:
                async for raw in stream:
                    if isinstance(raw, bytes) and not timer.feed(raw):
                        break
        finally:
            await stream.aclose()
    except Exception as error:  # a load generator counts failures; it does not stop
        timer.result.error = f"{type(error).__name__}: {error}"
        if isinstance(error, httpx.TransportError):  # httpx's message names no address
            timer.result.error += f" ({target.endpoint(chat)})"
    return timer.finish()


def open_client(target: Target, kind: str = "auto") -> Any:
    """An HTTP client for the run: aiohttp when installed (its C parser adds less
    latency per chunk, as vLLM's own benchmark client does), else httpx."""
    if kind in ("auto", "aiohttp"):
        try:
            import aiohttp
        except ImportError:
            if kind == "aiohttp":
                raise ValueError("--http-client aiohttp: aiohttp is not installed") from None
        else:
            return aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=target.timeout_s, connect=30.0),
            )
    return httpx.AsyncClient(
        timeout=httpx.Timeout(target.timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    )


class Progress:
    """A one-line progress indicator on stderr (a line per 10% when not a terminal)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.done = self.failed = 0
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._shown = -1

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += 0 if result.ok else 1
        tenth = self.done * 10 // max(self.total, 1)
        if self.tty or tenth != self._shown:
            self._shown = tenth
            self.show()

    def show(self, end: str = "") -> None:
        width = 30
        filled = width * self.done // max(self.total, 1)
        line = (
            f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
            f" failed {self.failed}  {time.monotonic() - self.started:.1f}s"
        )
        sys.stderr.write(("\r" + line + end) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


async def run_once(
    conversations: Sequence[Conversation],
    target: Target,
    schedule: Schedule,
    on_result: Callable[[RequestResult], None] | None = None,
    client: Any = None,
    http_client: str = "auto",
) -> tuple[list[RequestResult], float]:
    """Play the conversations; return every request's result and the run's duration."""
    if schedule.use_timestamps:
        starts = [c.at or 0.0 for c in conversations]
    else:
        starts = arrival_times(
            len(conversations), schedule.rate, schedule.burstiness, schedule.seed
        )
    limit = asyncio.Semaphore(schedule.concurrency) if schedule.concurrency else None
    results: list[RequestResult] = []
    own = client is None
    if client is None:
        client = open_client(target, http_client)
    t0 = time.perf_counter()
    deadline = t0 + schedule.duration_s if schedule.duration_s else math.inf

    async def play(conversation: Conversation, at: float) -> None:
        if t0 + at >= deadline:
            return  # scheduled after the run's end: never sent
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if time.perf_counter() >= deadline:
            return
        if limit is not None:
            await limit.acquire()
        try:
            history: list[dict[str, str]] | None = None
            if conversation.chat:
                history = [{"role": r, "content": c} for r, c in conversation.history]
            for turn in conversation.turns:
                if time.perf_counter() >= deadline:
                    return
                sent = time.perf_counter() - t0
                result, text = await send(client, target, turn, history)
                result.start = sent
                results.append(result)
                if on_result is not None:
                    on_result(result)
                if not result.ok:
                    return  # a broken conversation does not continue
                if history is not None:
                    history += [
                        {"role": "user", "content": turn.prompt},
                        {"role": "assistant", "content": text},
                    ]
        finally:
            if limit is not None:
                limit.release()

    try:
        await asyncio.gather(*(play(c, at) for c, at in zip(conversations, starts, strict=True)))
    finally:
        if own and isinstance(client, httpx.AsyncClient):
            await client.aclose()
        elif own:
            await client.close()
    return results, time.perf_counter() - t0
