"""The picker's HTTP/2 classes (rpc.py) answer what h2's and hpack's own do.

The connection class (`rpc.QuietH2Connection`: h2's without the trace
line it formats per frame) answers what h2's own does, frame for frame, on the paths its
copy of `_receive_frame` handles: a frame on a stream the server reset (kept or already
forgotten: a RST_STREAM back), and one on a stream that ended normally (a connection
error). h2 handles a stray DATA frame itself; a HEADERS frame reaches those paths.

The header coders (`rpc.RememberingDecoder`, `rpc.RememberingEncoder`) turn every block
and header list into what hpack's own do, also when one they remember comes again after
the dynamic table changed.

`rpc.LeanCall.read` reads the same messages, errors and acknowledgements as grpclib's
buffer reads, from grpclib's buffer and from one whose chunks are in a `rpc.OneReaderQueue`
(the picker's ext_proc streams); that queue answers as `asyncio.Queue` also when its
reader is cancelled while it waits."""

from __future__ import annotations

import asyncio
import random
import struct
from collections.abc import Callable
from typing import Any

import pytest
from grpclib.exceptions import GRPCError
from grpclib.protocol import Buffer
from grpclib.server import Handler, Server
from h2.config import H2Configuration
from h2.connection import H2Connection
from hpack import Decoder, Encoder
from hyperframe.frame import HeadersFrame
from kubellm.gateway.epp import messages as m
from kubellm.gateway.epp.rpc import (
    EOF,
    Call,
    ExtProc,
    Health,
    LeanCall,
    LeanHandler,
    OneReaderQueue,
    QuietH2Connection,
    RememberingDecoder,
    RememberingEncoder,
    SilentLogger,
    _server,
    lean_buffer,
)

HEADERS = [(":method", "POST"), (":path", "/x"), (":scheme", "http"), (":authority", "a")]


def _client() -> tuple[H2Connection, bytes]:
    client = H2Connection(H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, HEADERS)
    return client, client.data_to_send()


def _stray_headers(stream_id: int) -> bytes:
    block = Encoder().encode([("x-stray", "1")], huffman=False)
    return HeadersFrame(stream_id, data=block, flags=["END_HEADERS", "END_STREAM"]).serialize()


def _reset_then_headers(server: H2Connection, client: H2Connection, opening: bytes) -> list[Any]:
    server.receive_data(opening)
    server.reset_stream(1)
    return [server.receive_data(_stray_headers(1))]


def _reset_forgotten_then_headers(
    server: H2Connection, client: H2Connection, opening: bytes
) -> list[Any]:
    server.receive_data(opening)
    server.reset_stream(1)
    client.send_headers(3, HEADERS, end_stream=True)
    events = [server.receive_data(client.data_to_send())]
    server.open_inbound_streams  # noqa: B018 (h2 forgets closed streams as it counts)
    return [*events, server.receive_data(_stray_headers(1))]


def _ended_then_headers(server: H2Connection, client: H2Connection, opening: bytes) -> list[Any]:
    client.end_stream(1)
    server.receive_data(opening + client.data_to_send())
    server.send_headers(1, [(":status", "200")], end_stream=True)
    client.send_headers(3, HEADERS, end_stream=True)
    server.receive_data(client.data_to_send())
    server.open_inbound_streams  # noqa: B018
    return [server.receive_data(_stray_headers(1))]


def _run(cls: type[H2Connection], steps: Callable[..., list[Any]]) -> tuple[Any, ...]:
    server = cls(H2Configuration(client_side=False))
    server.initiate_connection()
    client, opening = _client()
    try:
        events = steps(server, client, opening)
    except Exception as error:
        return ("raised", type(error).__name__, server.data_to_send())
    return ("events", [[repr(e) for e in batch] for batch in events], server.data_to_send())


@pytest.mark.parametrize(
    "steps",
    [_reset_then_headers, _reset_forgotten_then_headers, _ended_then_headers],
    ids=["reset", "reset-forgotten", "ended"],
)
def test_the_quiet_connection_answers_as_h2s_own(steps: Callable[..., list[Any]]) -> None:
    ours, h2s = _run(QuietH2Connection, steps), _run(H2Connection, steps)
    assert ours == h2s
    assert ours[2]  # something was answered (a RST_STREAM, or a GOAWAY)


# A table of 40 bytes holds one entry of 34 (1 + 1 + 32): adding ("b", "2") evicts
# ("a", "1") and leaves the table's length and size as they were, only its entry differs.
RESIZE_40 = bytes([0x3F, 0x09])
ADD_A1 = bytes([0x40, 0x01]) + b"a" + bytes([0x01]) + b"1"
ADD_B2 = bytes([0x40, 0x01]) + b"b" + bytes([0x01]) + b"2"
NEWEST = bytes([0x80 | 62])  # the dynamic table's first entry


def _decoded(decoder: Decoder, blocks: list[bytes]) -> list[list[tuple[bytes, bytes]]]:
    return [[tuple(h) for h in decoder.decode(block, raw=True)] for block in blocks]


def test_a_remembered_block_decodes_anew_once_the_table_changed() -> None:
    blocks = [RESIZE_40 + ADD_A1, NEWEST, NEWEST, ADD_B2, NEWEST, NEWEST]
    ours = RememberingDecoder()
    assert _decoded(ours, blocks) == _decoded(Decoder(), blocks)
    assert _decoded(ours, [NEWEST]) == [[(b"b", b"2")]]
    assert (NEWEST, True) in ours._kept  # the block was remembered (and not used stale)


def test_the_remembering_decoder_decodes_as_hpacks_own() -> None:
    rng = random.Random(7)
    sets = [
        [(":method", "POST"), (":path", f"/p{i % 3}"), ("x-n", str(rng.randrange(4)))]
        for i in range(40)
    ]
    encoder = Encoder()
    encoder.header_table_size = 96  # small: entries are evicted as the run goes on
    blocks = []
    for headers in sets:
        sensitive = rng.random() < 0.5  # never-indexed literals: the table unchanged
        blocks.append(encoder.encode([(k, v, sensitive) for k, v in headers]))
    ours, reference = RememberingDecoder(), Decoder()
    assert _decoded(ours, blocks) == _decoded(reference, blocks)


def _encoded(encoder: Encoder, lists: list[list[tuple[str, str]]]) -> list[bytes]:
    return [encoder.encode(headers) for headers in lists]


def test_a_remembered_header_list_is_encoded_anew_once_the_table_changed() -> None:
    # a table of 40 bytes holds one entry of 34: ("b", "2") takes ("a", "1")'s place
    # with the same length and size, so only the entry's identity tells the tables apart
    ours, reference = RememberingEncoder(), Encoder()
    for encoder in (ours, reference):
        encoder.header_table_size = 40
    lists = [[("a", "1")], [("a", "1")], [("a", "1")], [("b", "2")], [("a", "1")], [("a", "1")]]
    assert _encoded(ours, lists) == _encoded(reference, lists)
    assert (((("a", "1"),), True)) in ours._kept  # remembered, and not used stale


def test_the_remembering_encoder_encodes_as_hpacks_own() -> None:
    rng = random.Random(11)
    ours, reference = RememberingEncoder(), Encoder()
    for encoder in (ours, reference):
        encoder.header_table_size = 120  # small: entries are evicted as the run goes on
    lists = [
        [(":status", "200"), ("content-type", "application/grpc+proto"),
         ("grpc-status", str(rng.randrange(3)))]
        for _ in range(60)
    ]  # fmt: skip
    assert _encoded(ours, lists) == _encoded(reference, lists)
    decoder = Decoder()  # and what it wrote decodes back
    blocks = _encoded(RememberingEncoder(), lists)
    decoded = [[tuple(h) for h in decoder.decode(block)] for block in blocks]
    assert decoded == [[tuple(h) for h in headers] for headers in lists]


# ------------------------------------------------------------------ reads (LeanCall.read)


class _Raw:
    """What a call reads from: grpclib's own stream buffer, the acknowledgements noted."""

    def __init__(self, queue: str = "grpclib") -> None:
        self.acks: list[int] = []
        self.buffer = Buffer(self.acks.append)
        if queue == "one-reader":
            lean_buffer(self.buffer)

    async def recv_data(self, size: int) -> bytes:
        return await self.buffer.read(size)


def _message(i: int) -> bytes:
    request = m.ProcessingRequest()
    request.request_body.body = b"x" * i
    request.request_body.end_of_stream = i % 2 == 0
    data = request.SerializeToString()
    return struct.pack(">?I", False, len(data)) + data


async def _waiting(raw: _Raw, reader: asyncio.Task[Any]) -> None:
    """Until the reader waits for the buffer's next chunk (or has ended); bounded."""
    for _ in range(1000):
        queue = raw.buffer._unacked
        waiting = queue._waiter if isinstance(queue, OneReaderQueue) else queue._getters
        if reader.done() or waiting:
            return
        await asyncio.sleep(0)
    raise AssertionError("the reader never waited for a chunk")


async def _read_all(
    lean: bool,
    chunks: list[tuple[bytes, int]],
    limit: int,
    early: bool = True,
    queue: str = "grpclib",
) -> list[Any]:
    """Every message a call reads from `chunks` (in the buffer before the first read when
    `early`, else each one added once the reader waits for it), with the acknowledgements
    made so far after each; an error ends the list. `queue`: the buffer's queue of chunks,
    grpclib's (`asyncio.Queue`) or the picker's (`OneReaderQueue`)."""
    raw = _Raw(queue)
    pending = [*chunks, (b"", 0)]  # (b"", 0): the end of the stream
    if early:
        for data, ack in chunks:
            raw.buffer.add(data, ack)
        raw.buffer.eof()
        pending = []
    if lean:
        call: Call = LeanCall(raw, limit)
    else:
        call = Call.__new__(Call)
        call.raw, call.max_message = raw, limit
    out: list[Any] = []
    for _ in range(len(chunks) + 2):
        reader = asyncio.ensure_future(call.read())
        await _waiting(raw, reader)
        while pending and not reader.done():
            data, ack = pending.pop(0)
            if ack:
                raw.buffer.add(data, ack)
            else:
                raw.buffer.eof()
            await _waiting(raw, reader)
        try:
            got = await reader
        except GRPCError as error:
            out.append(("error", error.status))
            break
        except AssertionError as error:  # grpclib's, for a stream ending inside a message
            out.append(("raised", str(error)))
            break
        out.append(got if got is EOF else got.SerializeToString())
        out.append(list(raw.acks))
        if got is EOF:  # and a read after the end ends at once again
            out.append(await asyncio.wait_for(call.read(), 5) is EOF)
            break
    return out


READS = {
    "whole": [(_message(i), len(_message(i)) + 3) for i in range(4)],
    "split": [(_message(9)[:3], 3), (_message(9)[3:], 20)],
    "two-in-one": [(_message(1) + _message(2), 40)],
    "compressed": [(b"\x01" + _message(3)[1:], 9)],
    "over-the-limit": [(_message(200), 300)],
    "empty-message": [(b"\0\0\0\0\0", 5)],
    "short": [(_message(5)[:-1], 9)],
}


@pytest.mark.parametrize("name", sorted(READS))
@pytest.mark.parametrize("early", [True, False], ids=["queued", "awaited"])
@pytest.mark.parametrize(
    ("lean", "queue"),
    [(True, "grpclib"), (True, "one-reader"), (False, "one-reader")],
    ids=["lean-call", "lean-call-one-reader", "call-one-reader"],
)
def test_the_lean_read_reads_as_grpclibs_buffer(
    name: str, early: bool, lean: bool, queue: str
) -> None:
    """The same messages, errors and acknowledgements (flow control) as `Call.read` on
    grpclib's own buffer (the library's path), the chunks already there or arriving while
    the reader waits."""
    ours = asyncio.run(_read_all(lean, READS[name], 100, early, queue))
    assert ours == asyncio.run(_read_all(False, READS[name], 100, early))


async def _queue_steps(queue: Any) -> list[Any]:
    """A queue's answers to one reader: items put before and while it waits, a wait
    cancelled (then an item put, and read by the next get), sizes and emptiness."""
    out: list[Any] = [queue.empty(), queue.qsize()]
    try:
        queue.get_nowait()
    except asyncio.QueueEmpty:
        out.append("empty")
    queue.put_nowait(1)
    queue.put_nowait(2)
    out += [queue.qsize(), await queue.get(), queue.get_nowait(), queue.empty()]
    waiting = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0)
    queue.put_nowait(3)
    out.append(await waiting)
    cancelled = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.sleep(0)
    out.append(cancelled.cancelled())
    queue.put_nowait(4)  # after the cancelled wait: kept for the next get
    out += [queue.qsize(), await asyncio.wait_for(queue.get(), 5)]
    late = asyncio.ensure_future(queue.get())  # an item put and the wait cancelled at once
    await asyncio.sleep(0)
    queue.put_nowait(5)
    late.cancel()
    await asyncio.sleep(0)
    out.append(late.cancelled())
    out += [queue.qsize(), await asyncio.wait_for(queue.get(), 5), queue.empty()]
    return out


def test_the_one_reader_queue_answers_as_asyncios() -> None:
    ours = asyncio.run(_queue_steps(OneReaderQueue()))
    assert ours == asyncio.run(_queue_steps(asyncio.Queue()))


@pytest.mark.parametrize("early", [True, False], ids=["queued", "awaited"])
def test_the_lean_read_takes_a_whole_message_without_grpclibs_reads(early: bool) -> None:
    raw = _Raw()

    async def refused(size: int) -> bytes:
        raise AssertionError("the buffer's read was used for a whole message")

    raw.recv_data = refused  # type: ignore[method-assign]

    async def read() -> Any:
        if early:
            raw.buffer.add(_message(4), 77)
        reader = asyncio.ensure_future(LeanCall(raw, 100).read())
        await _waiting(raw, reader)
        if not early:
            raw.buffer.add(_message(4), 77)
        return await reader

    got = asyncio.run(read())
    assert got.request_body.body == b"xxxx" and raw.acks == [77]


class _Transport:
    """Enough of a transport for `connection_made`: nothing is sent anywhere."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def get_extra_info(self, name: str) -> Any:
        return None

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False


def test_the_pickers_connections_take_the_lean_classes() -> None:
    async def made() -> Any:
        protocol = _server([ExtProc(lambda call: asyncio.sleep(0), 100)], 8)._protocol_factory()
        protocol.connection_made(_Transport())
        return protocol.connection._connection

    h2 = asyncio.run(made())
    assert isinstance(h2.config.logger, SilentLogger)
    assert type(h2) is QuietH2Connection
    assert type(h2.decoder) is RememberingDecoder and type(h2.encoder) is RememberingEncoder


def test_the_silent_logger_takes_h2s_lines_and_returns_nothing() -> None:
    """h2 calls `debug` and `trace` with a format and its arguments (keywords too)."""
    logger = SilentLogger()
    assert logger.debug("Stream ID %d created", 1) == ""
    assert logger.trace("Process received data: %r", b"x", extra={"a": 1}) == ""
    assert logger.debug() == ""


@pytest.mark.parametrize("name", sorted(READS))
def test_a_call_is_ready_only_when_its_read_cannot_wait(name: str) -> None:
    """`ready` (the picker then reads without the body deadline's timer) is True only for
    a whole message first in the buffer: the read then returns without waiting. A part of
    a message, or one the read refuses, is not ready (the timer still bounds the wait)."""

    raw = _Raw()
    call = LeanCall(raw, 100)
    assert not call.ready()  # nothing there
    for data, ack in READS[name]:
        raw.buffer.add(data, ack)
    expected = name == "whole"
    assert call.ready() is expected
    if expected:  # the read ends at its first step: it never waits
        reading = call.read()
        with pytest.raises(StopIteration) as ended:
            reading.send(None)
        first = m.parse(READS[name][0][0][5:])
        assert ended.value.value.SerializeToString() == first.SerializeToString()
    plain = Call.__new__(Call)  # grpclib's read path: never ready
    assert not plain.ready()


# ------------------------------------------------------------------ stream opening (LeanHandler)

EXT_PROC_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
PLAIN = [(":method", "POST"), (":scheme", "http"), (":path", EXT_PROC_PATH),
         (":authority", "epp"), ("content-type", "application/grpc"), ("te", "trailers"),
         ("x-envoy-internal", "true")]  # fmt: skip
OPENINGS = {
    "plain": PLAIN,
    "plain-proto": [*PLAIN[:4], ("content-type", "application/grpc+proto"), *PLAIN[5:]],
    "repeated-path": [*PLAIN, (":path", "/grpc.health.v1.Health/Check")],
    "health": [*PLAIN[:2], (":path", "/grpc.health.v1.Health/Check"), *PLAIN[3:]],
    "deadline": [*PLAIN, ("grpc-timeout", "5S")],
    "get": [(":method", "GET"), *PLAIN[1:]],
    "json": [*PLAIN[:4], ("content-type", "application/grpc+json"), *PLAIN[5:]],
    "no-te": [h for h in PLAIN if h[0] != "te"],
    "repeated-te": [*PLAIN, ("te", "gzip")],
    "non-ascii": [*PLAIN, ("x-name", "caf\u00e9")],
}


def _opened(make: Callable[[], Any], headers: list[tuple[str, str]]) -> tuple[Any, ...]:
    """What a server's protocol does with a stream opened by `headers` (UTF-8 on the wire):
    the headers grpclib's handler is given, or that `ExtProc.serve` took the stream, or
    the error out of `data_received`."""
    seen: list[Any] = []

    class Recording(Handler):
        def accept(self, stream: Any, headers: Any, release_stream: Any) -> None:
            seen.append(("grpclib", [(type(h).__name__, *h) for h in headers]))

    async def serve(self: Any, raw: Any, release_stream: Any) -> None:
        seen.append(("lean", type(raw.buffer._unacked).__name__))

    async def run() -> None:
        protocol = make()._protocol_factory()
        handler = protocol.handler
        if isinstance(handler, LeanHandler):
            handler.__class__ = type("LeanRecording", (LeanHandler, Recording), {})
        else:
            handler.__class__ = Recording
        protocol.connection_made(_Transport())
        client = H2Connection(H2Configuration(client_side=True, validate_outbound_headers=False))
        client.initiate_connection()
        client.send_headers(1, [(n.encode(), v.encode()) for n, v in headers])
        try:
            protocol.data_received(client.data_to_send())
        except Exception as error:
            seen.append(("raised", type(error).__name__))
        await asyncio.sleep(0)

    original = ExtProc.serve
    ExtProc.serve = serve  # type: ignore[method-assign]
    try:
        asyncio.run(run())
    finally:
        ExtProc.serve = original  # type: ignore[method-assign]
    return tuple(seen)


@pytest.mark.parametrize("name", sorted(OPENINGS))
@pytest.mark.parametrize("served", ["ext-proc-and-health", "health-alone"])
def test_a_stream_opens_as_on_grpclibs_server(name: str, served: str) -> None:
    """The picker's server (headers received in bytes) hands a stream to grpclib with the
    headers grpclib's own server (h2 decoding them as ASCII) gives its handler, and the
    same error for a byte outside ASCII; a plain ext_proc stream is served lean (its
    chunks in a `OneReaderQueue`). Also the health port's server (no ext_proc: every
    stream is grpclib's)."""
    ext_proc = ExtProc(lambda call: asyncio.sleep(0), 100)
    handlers: list[Any] = [Health([""])]
    if served == "ext-proc-and-health":
        handlers.insert(0, ext_proc)
    ours = _opened(lambda: _server(handlers, 8), OPENINGS[name])
    library = _opened(lambda: Server(handlers), OPENINGS[name])
    if name.startswith("plain") and served == "ext-proc-and-health":
        assert ours == (("lean", "OneReaderQueue"),)
        assert library[0][0] == "grpclib"
    else:
        assert ours == library
        assert ours[0][0] == ("raised" if name == "non-ascii" else "grpclib")
