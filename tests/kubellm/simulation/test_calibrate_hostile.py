"""`kubellm plan --calibrate URL` against replicas that misbehave on loopback: one that
trickles its /v1/models a byte at a time, and ones that send an endless line (as the
listing, as a completion stream). Each call ends with a clear error within its deadline,
and memory stays bounded while the peer keeps sending."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from kubellm.simulation import calibrate

HANG = 60.0  # a guard against a hang, not a speed bound
ENDLESS_BYTES = 128 * 1024 * 1024  # what the endless peers send at most before closing
MEMORY_BOUND = 16 * 1024 * 1024  # the bounds' 1 MiB plus chunks and copies, far under it

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serving(handler: Handler, call: Callable[[str], Awaitable[Any]]) -> Any:
    """Run `call(url)` against a loopback server answering every connection with `handler`."""

    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")  # the request head; its body is not needed
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client hung up: what a bounded client does
        finally:
            writer.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        return await asyncio.wait_for(call(f"http://127.0.0.1:{port}"), HANG)


async def _trickle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4096\r\n\r\n")
    for _ in range(1200):  # a byte every 0.1 s: at most 1,200 bytes over 120 s
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(0.1)


def _endless(head: bytes, content_type: bytes) -> Handler:
    async def send(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\n\r\n" + head)
        chunk = b"x" * 65536
        for _ in range(ENDLESS_BYTES // len(chunk)):  # one line, no newline, then close
            writer.write(chunk)
            await writer.drain()

    return send


def test_a_trickling_model_list_ends_within_the_deadline() -> None:
    with pytest.raises(calibrate.CalibrationError, match=r"cannot list its models: no whole "):
        asyncio.run(_serving(_trickle, lambda url: calibrate.served_model(url, timeout=1.0)))


def _peak(run: Callable[[], Any]) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        try:
            result = run()
        except calibrate.CalibrationError as error:
            result = error
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_endless_model_list_is_refused_in_bounded_memory() -> None:
    handler = _endless(b'{"data": [{"id": "', b"application/json")
    error, peak = _peak(lambda: asyncio.run(_serving(handler, calibrate.served_model)))
    assert isinstance(error, calibrate.CalibrationError), error
    assert "cannot list its models" in str(error) and "larger than" in str(error)
    assert peak < MEMORY_BOUND, f"peak {peak / 2**20:.0f} MiB"


def test_an_endless_stream_line_is_an_error_in_bounded_memory() -> None:
    handler = _endless(b'data: {"choices": [{"text": "', b"text/event-stream")

    async def one(url: str) -> calibrate.Streamed:
        target = calibrate.Target(url, "m", timeout_s=HANG)
        async with httpx.AsyncClient(timeout=HANG) as client:
            return await calibrate.stream_one(client, target, "hello", 4)

    streamed, peak = _peak(lambda: asyncio.run(_serving(handler, one)))
    assert streamed.error is not None and "line longer than" in streamed.error, streamed
    assert peak < MEMORY_BOUND, f"peak {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    ("chunks", "lines"),
    [
        ([b"data: a\n\ndata: b\r\n", b"\n"], ["data: a", "", "data: b", ""]),
        ([b"da", b"ta: a", b"\ndata: [DONE]"], ["data: a", "data: [DONE]"]),
        ([b"\xe2\x82", b"\xac\n"], ["\u20ac"]),  # a character split across chunks
    ],
)
def test_bounded_lines_split_as_a_line_reader_does(chunks: list[bytes], lines: list[str]) -> None:
    async def collect() -> list[str]:
        async def source() -> Any:
            for chunk in chunks:
                yield chunk

        return [line async for line in calibrate.bounded_lines(source())]

    assert asyncio.run(collect()) == lines
