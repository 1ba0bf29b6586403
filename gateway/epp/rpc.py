"""The picker's gRPC server: ext_proc and the gRPC health services on grpclib (asyncio
HTTP/2 on the `h2` library), in the event loop's own thread.

Why not grpcio's grpc.aio: its C core polls and completes on threads of its own and hands
every message to the event loop and back (17-22 context switches per request across 13
threads, 1.9 ms of CPU per request with Envoy, issue 38). Here a message is read, routed
and answered in one turn of the loop, and the writes of one turn leave in one send
(`Coalescing`): ~0.3 context switches per request (docs/operations.md, "The endpoint
picker's cost").
An ext_proc stream of the plain form Envoy opens (no deadline, the proto codec) skips
grpclib's per-stream server machinery (`LeanHandler`): its messages go straight to the
HTTP/2 stream, the headers and trailers are built once; a message that arrived whole in
one DATA frame is taken from the stream's buffer in one step (`LeanCall.read`), whose
chunks wait in a one-reader queue (`OneReaderQueue`, not an `asyncio.Queue`); h2's debug
lines go to a logger that drops them without a Python call (`SilentLogger`); h2 hands the
server the headers it received in bytes, undecoded (`header_encoding` None): the plain form
is told from four of them, any other stream gets them decoded as h2 would. Every
frame is still parsed by hyperframe and h2 (a fast path that read DATA frame headers by hand
gave -2.2% of the picker's instructions and was taken out: the HTTP/2 framing is theirs).

Bounds a hostile peer meets (the port has no authentication): a message longer than
`max_message` is refused with RESOURCE_EXHAUSTED before its bytes are read (grpclib itself
reads whatever length a message announces); HTTP/2 flow control bounds the bytes held per
stream and connection (grpclib acknowledges data only as it is read); streams per
connection are capped (twice `max_streams`, the picker's own cap across connections);
header lists at h2's 64 KiB.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from grpc_health.v1 import health_pb2
from grpclib import const
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.metadata import encode_grpc_message
from grpclib.protocol import Buffer, H2Protocol
from grpclib.server import Handler, Server, Stream
from grpclib.utils import Wrapper
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.exceptions import (
    FlowControlError,
    FrameTooLargeError,
    StreamClosedError,
    StreamIDTooLowError,
)
from h2.settings import SettingCodes
from hpack import Decoder, Encoder
from hyperframe.frame import RstStreamFrame
from kubellm.gateway.epp import messages as m

log = logging.getLogger("kubellm.epp.rpc")

EOF = object()  # `Call.read` at the end of the client's messages
HEALTH = "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Codec(CodecBase):
    """Messages parsed by their class (messages.py's descriptor pool for ext_proc); answers
    written as messages, or as the bytes messages.py keeps for the constant ones."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return m.serialize(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return message_type.FromString(data)


class Call:
    """One ext_proc stream as `EndpointPicker.process` reads and writes it."""

    __slots__ = ("max_message", "raw", "stream")

    def __init__(self, stream: Stream, max_message: int) -> None:
        self.stream = stream
        self.raw = stream._stream  # grpclib.protocol.Stream: the HTTP/2 stream's data
        self.max_message = max_message

    async def read(self) -> Any:
        """The next message, or EOF. Its length prefix is checked before its bytes are
        read (grpclib's `recv_message` would read any length)."""
        raw = self.raw
        prefix = await raw.recv_data(5)
        if not prefix:
            return EOF
        compressed, length = struct.unpack(">?I", prefix)
        if compressed:
            raise GRPCError(const.Status.UNIMPLEMENTED, "compressed messages are not accepted")
        if length > self.max_message:
            raise GRPCError(
                const.Status.RESOURCE_EXHAUSTED,
                f"message of {length} bytes exceeds the limit of {self.max_message}",
            )
        data = await raw.recv_data(length)
        if len(data) != length:
            raise GRPCError(const.Status.INVALID_ARGUMENT, "the stream ended inside a message")
        return m.parse(data)

    async def write(self, answer: Any) -> None:
        await self.stream.send_message(answer)

    def ready(self) -> bool:
        """True when `read` will return a message without waiting (False: it may wait)."""
        return False

    async def abort(self, status: const.Status, details: str) -> None:
        raise GRPCError(status, details)


_CONTENT_TYPE = "application/grpc+proto"
_PREFIX = struct.Struct(">?I")  # a gRPC message's prefix: compressed, length
_LENGTH = struct.Struct(">I")
_INITIAL = ((b":status", b"200"), (b"content-type", _CONTENT_TYPE.encode()))
_PLAIN_TYPES = frozenset({"application/grpc", _CONTENT_TYPE})
_PLAIN_TYPES_RAW = frozenset(kind.encode() for kind in _PLAIN_TYPES)


class LeanCall(Call):
    """A `Call` written straight to the HTTP/2 stream (`LeanHandler`): the answer
    serialised (or the bytes kept for it), framed and sent, the response's headers before
    the first one; what grpclib's server `Stream.send_message` sends, without its event
    dispatch and per-call header encoding."""

    __slots__ = ("started",)

    def __init__(self, raw: Any, max_message: int) -> None:
        self.raw, self.max_message, self.started = raw, max_message, False

    async def read(self) -> Any:
        """`Call.read`, taking a message that arrived whole in one DATA frame (Envoy sends
        each message so) straight from the stream's buffer: grpclib's `Buffer.read` would
        move that chunk to its acknowledged list, acknowledge it and split it in two reads.
        The same chunk is acknowledged here (flow control as before); anything else (a
        message over several frames or several in one, compressed, over the limit, the
        stream's end) is put back in front as it was and takes `Call.read`."""
        buffer = self.raw.buffer
        unacked = buffer._unacked  # a queue of the chunks not yet read (`OneReaderQueue`)
        if not buffer._acked and not (buffer._eof and unacked.empty()):
            chunk = await unacked.get()  # the next chunk, as grpclib's read waits for it
            if self._whole(chunk):
                buffer._ack_callback(chunk[2])
                return m.parse(chunk[0][5:])
            unacked._queue.appendleft(chunk)  # untouched, first again: grpclib's read takes it
        return await Call.read(self)

    def _whole(self, chunk: Any) -> bool:
        """The chunk (data, size, size acknowledged) is one uncompressed message within
        the limit."""
        data, size, ack_size = chunk
        length = size - 5
        return (
            length > 0
            and ack_size
            and data[0] == 0  # not compressed
            and _LENGTH.unpack_from(data, 1)[0] == length
            and length <= self.max_message
        )

    def ready(self) -> bool:
        """A whole message is first in the stream's buffer: `read` takes it without
        waiting (Envoy's first message comes with the stream's HEADERS frame)."""
        buffer = self.raw.buffer
        queued = buffer._unacked._queue
        return bool(queued) and not buffer._acked and self._whole(queued[0])

    async def write(self, answer: Any) -> None:
        data = m.serialize(answer)
        raw = self.raw
        if not self.started:
            await raw.send_headers(list(_INITIAL))
            self.started = True
        framed = _PREFIX.pack(False, len(data)) + data
        size = len(framed)
        connection, h2 = raw.connection, raw._h2_connection
        if connection.write_ready.is_set():
            # one DATA frame, if the windows and the frame size take it now (h2 checks both
            # before it changes anything): what grpclib's `send_data` does for it
            try:
                h2.send_data(raw.id, framed)
            except (FlowControlError, FrameTooLargeError):
                pass
            else:
                raw._transport.write(h2.data_to_send())
                raw.data_sent += size
                connection.data_sent += size
                connection.data_send_process()
                return
        await raw.send_data(framed)  # split to the frame size, waiting for the windows


class OneReaderQueue:
    """What grpclib's `Buffer` asks of its `asyncio.Queue` of chunks (`put_nowait`, `get`,
    `get_nowait`, `empty`, `qsize`), for the one task that reads a stream: a deque and a
    future while that task waits. `asyncio.Queue` serves any number of readers and writers
    with a bound (getter and putter lists, a task counter, an event per `put`): ~10 Python
    calls per chunk more, three chunks per request (`test_rpc.py` reads with both)."""

    __slots__ = ("_queue", "_waiter")

    def __init__(self) -> None:
        self._queue: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self._queue.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Any:
        queue = self._queue
        while not queue:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return queue.popleft()

    def get_nowait(self) -> Any:
        if not self._queue:
            raise asyncio.QueueEmpty
        return self._queue.popleft()

    def empty(self) -> bool:
        return not self._queue

    def qsize(self) -> int:
        return len(self._queue)


def lean_buffer(buffer: Buffer) -> Buffer:
    """`buffer` (a new stream's, nothing in it yet) with its chunks in a `OneReaderQueue`:
    grpclib's `Buffer` code reads and acknowledges them as before."""
    assert buffer._unacked.empty() and not buffer._acked and not buffer._eof
    buffer._unacked = OneReaderQueue()  # type: ignore[assignment]
    return buffer


Process = Callable[[Call], Awaitable[None]]


class ExtProc:
    """The ExternalProcessor service: each stream handed to `process` as a `Call`."""

    def __init__(self, process: Process, max_message: int) -> None:
        self.process, self.max_message = process, max_message

    async def _process(self, stream: Stream) -> None:
        await self.process(Call(stream, self.max_message))

    async def serve(self, raw: Any, release_stream: Callable[[], Any]) -> None:
        """One stream of the plain form (`LeanHandler`), to its end: what grpclib's
        `request_handler` and its server `Stream` do for it (the status in the trailers, a
        trailers-only answer when nothing was sent, the stream reset after an error), minus
        the checks the form already passed and the deadline it does not carry."""
        call = LeanCall(raw, self.max_message)
        wrapper = raw.wrapper = Wrapper()  # a reset or a closed connection ends the reads
        status, details = const.Status.OK, None
        try:
            try:
                with wrapper:
                    await self.process(call)
            except GRPCError as error:
                status, details = error.status, error.message
            except StreamTerminatedError as error:
                log.info("Request was cancelled: %s", error)
                return
            except Exception:
                log.exception("Application error")
                status, details = const.Status.UNKNOWN, "Internal Server Error"
            if raw._transport.is_closing():
                return
            headers = [] if call.started else list(_INITIAL)
            headers.append((b"grpc-status", str(status.value).encode()))
            if details is not None:
                headers.append((b"grpc-message", encode_grpc_message(details).encode()))
            try:
                await raw.send_headers(headers, end_stream=True)
            except StreamClosedError:
                return
            if status is not const.Status.OK and raw.closable:
                raw.reset_nowait()
        except Exception:
            log.exception("Server error")
        finally:
            release_stream()

    def __mapping__(self) -> dict[str, const.Handler]:
        return {
            f"/{m.SERVICE}/{m.METHOD}": const.Handler(
                self._process,
                const.Cardinality.STREAM_STREAM,
                m.ProcessingRequest,
                m.ProcessingResponse,
            )
        }


class Health:
    """gRPC health (`grpc.health.v1`, the messages of grpcio-health-checking): Check, and
    Watch answering the status now and at each change."""

    def __init__(self, services: Iterable[str]) -> None:
        self.status = dict.fromkeys(services, SERVING)
        self.changed = asyncio.Event()

    def set_all(self, status: int) -> None:
        self.status = dict.fromkeys(self.status, status)
        self.changed.set()
        self.changed = asyncio.Event()

    def _of(self, service: str) -> int:
        status = self.status.get(service)
        if status is None:
            raise GRPCError(const.Status.NOT_FOUND, f"unknown service {service!r}")
        return status

    async def check(self, stream: Stream) -> None:
        request = await stream.recv_message()
        assert request is not None
        await stream.send_message(health_pb2.HealthCheckResponse(status=self._of(request.service)))

    async def watch(self, stream: Stream) -> None:
        request = await stream.recv_message()
        assert request is not None
        while True:
            changed = self.changed
            await stream.send_message(
                health_pb2.HealthCheckResponse(status=self._of(request.service))
            )
            await changed.wait()

    def __mapping__(self) -> dict[str, const.Handler]:
        one, many = const.Cardinality.UNARY_UNARY, const.Cardinality.UNARY_STREAM
        request, response = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        return {
            f"/{HEALTH}/Check": const.Handler(self.check, one, request, response),
            f"/{HEALTH}/Watch": const.Handler(self.watch, many, request, response),
        }


class Coalescing:
    """A transport whose writes within one turn of the event loop leave in one send:
    grpclib writes each frame group as it is made (headers, a message, the trailers), and
    on loopback every send also runs the receiver's TCP path."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.pending: list[bytes] = []
        self.loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self.pending:
            self.loop.call_soon(self.flush)
        self.pending.append(data)

    def flush(self) -> None:
        if self.pending:
            data = b"".join(self.pending)
            self.pending.clear()
            if not self.transport.is_closing():
                self.transport.write(data)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:  # asked on every stream: not through `__getattr__`
        return self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # the rest of the transport's interface
        return getattr(self.transport, name)


class QuietH2Connection(H2Connection):
    """h2's connection less the trace line it formats for every frame received:
    `_receive_frame` builds `repr(frame)` (its flags, a hex dump of its data) for a logger
    that discards it, ~3% of the picker's instructions per request. The rest is h2's own
    `_receive_frame` (4.x; `test_rpc.py` compares the two on the error paths). The picker's
    server connections are switched to this class as they are made."""

    def _receive_frame(self, frame: Any) -> Any:
        try:
            frames, events = self._frame_dispatch_table[frame.__class__](frame)
        except StreamClosedError as error:
            # closed by RST_STREAM: a stream error (RST_STREAM back); else the connection's
            if not self._stream_is_closed_by_reset(error.stream_id):
                raise
            reset = RstStreamFrame(error.stream_id)
            reset.error_code = error.error_code
            self._prepare_for_sending([reset])
            events = error._events
        except StreamIDTooLowError as error:
            if self._stream_is_closed_by_reset(error.stream_id):
                reset = RstStreamFrame(error.stream_id)
                reset.error_code = ErrorCodes.STREAM_CLOSED
                self._prepare_for_sending([reset])
                events = []
            elif self._stream_is_closed_by_end(error.stream_id):
                raise StreamClosedError(error.stream_id) from error
            else:
                raise
        else:
            self._prepare_for_sending(frames)
        return events


class SilentLogger:
    """The logger h2 calls (`H2Configuration.logger`: "no I/O and no context switches")
    with its `debug` and `trace` lines, ~30 per ext_proc stream: h2's own `DummyLogger`
    discards them in a Python method (a frame, an argument tuple and dict per line);
    `"".format` takes any arguments and returns "" without a Python frame."""

    debug = trace = staticmethod("".format)


MAX_HEADER_BLOCKS_KEPT = 16


class RememberingDecoder(Decoder):
    """hpack's decoder, remembering the header blocks whose decoding left its dynamic table
    as it was: such a block decodes the same while the table stays so. Envoy opens every
    ext_proc stream with the same block (indexed fields and `:path` as a Huffman-coded
    literal it never indexes), which hpack decodes byte by byte in Python each time.

    The table's state is its length, size and bounds, and its newest entry by identity
    (every entry added is a new tuple at the front): a block that adds an entry, evicts
    one or resizes the table changes it and is not kept; any change of the table makes
    what was kept unusable (`_state` differs)."""

    _kept: dict[tuple[bytes, bool], tuple[Any, tuple[Any, ...], Any]]

    def _state(self) -> tuple[tuple[Any, ...], Any]:
        table = self.header_table
        entries = table.dynamic_entries
        shape = (len(entries), table._current_size, table.maxsize, self.max_allowed_table_size,
                 self.max_header_list_size)  # fmt: skip
        return shape, entries[0] if entries else None

    def decode(self, data: bytes, raw: bool = False) -> Any:
        kept = self.__dict__.get("_kept")
        if kept is None:
            kept = self._kept = {}
        key = (bytes(data), raw)
        shape, newest = self._state()
        found = kept.get(key)
        if found is not None and found[1] == shape and found[2] is newest:
            return list(found[0])
        headers = super().decode(data, raw)
        after, newest_after = self._state()
        if after == shape and newest_after is newest:
            if len(kept) >= MAX_HEADER_BLOCKS_KEPT:
                kept.clear()
            kept[key] = (tuple(headers), shape, newest)
        return headers


def _table_state(table: Any) -> tuple[tuple[Any, ...], Any]:
    """An HPACK table's state as the remembering coders compare it: its length, size and
    bounds, and its newest entry by identity (each entry added is a new tuple in front)."""
    entries = table.dynamic_entries
    shape = (len(entries), table._current_size, table.maxsize, table.resized)
    return shape, entries[0] if entries else None


class RememberingEncoder(Encoder):
    """hpack's encoder, remembering the header lists whose encoding left its dynamic table
    as it was (every field indexed): the picker's response headers and trailers, the same
    few lists on every stream once their fields are in the table. The same rules as
    `RememberingDecoder`."""

    _kept: dict[tuple[Any, bool], tuple[bytes, tuple[Any, ...], Any]]

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        kept = self.__dict__.get("_kept")
        if kept is None:
            kept = self._kept = {}
        if isinstance(headers, dict):
            return super().encode(headers, huffman)
        headers = [tuple(header) for header in headers]
        key = (tuple(headers), huffman)
        shape, newest = _table_state(self.header_table)
        found = kept.get(key)
        if found is not None and found[1] == shape and found[2] is newest:
            return found[0]
        block = super().encode(headers, huffman)
        after, newest_after = _table_state(self.header_table)
        if after == shape and newest_after is newest:
            if len(kept) >= MAX_HEADER_BLOCKS_KEPT:
                kept.clear()
            kept[key] = (block, shape, newest)
        return block


class LeanHandler(Handler):
    """grpclib's stream handler, except for ext_proc streams of the form Envoy opens
    (POST, `application/grpc` or `+proto`, `te: trailers`, no `grpc-timeout`): those are
    served by `ExtProc.serve` on the HTTP/2 stream directly. Any other stream (health, a
    deadline, a wrong method or content type) goes through grpclib's checks as before."""

    def __init__(self, made: Handler, lean: dict[str, ExtProc]) -> None:
        super().__init__(made.mapping, made.codec, made.status_details_codec, made.dispatch)
        self.lean = lean

    def accept(self, stream: Any, headers: Any, release_stream: Callable[[], Any]) -> None:
        """`headers` as h2 received them, in bytes (the server's `header_encoding` is None):
        an ext_proc stream of the plain form is told by four of them; any other stream gets
        them decoded as h2 would have (ASCII, the same `UnicodeDecodeError` for a byte
        outside it) and goes to grpclib."""
        values = dict(headers)  # the last of a repeated header, as grpclib reads them
        service = self.lean.get(values.get(b":path", b""))
        if (
            service is None
            or values.get(b":method") != b"POST"
            or values.get(b"content-type") not in _PLAIN_TYPES_RAW
            or values.get(b"te") != b"trailers"
            or b"grpc-timeout" in values
            or not b"".join(map(b"".join, headers)).isascii()
        ):
            super().accept(stream, decoded(headers), release_stream)
            return
        self.__gc_step__()
        lean_buffer(stream.buffer)
        self._tasks[stream] = self.loop.create_task(service.serve(stream, release_stream))


def decoded(headers: Any) -> list[Any]:
    """h2's `_decode_headers` (ASCII): each header of its own class (`HeaderTuple` or
    `NeverIndexedHeaderTuple`), name and value decoded."""
    return [header.__class__(header[0].decode("ascii"), header[1].decode("ascii"))
            for header in headers]  # fmt: skip


SILENT = SilentLogger()


def _server(handlers: list[Any], max_streams: int) -> Server:
    lean = {
        path.encode(): handler
        for handler in handlers
        if isinstance(handler, ExtProc)
        for path in handler.__mapping__()
    }

    class Protocol(H2Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(Coalescing(transport))
            h2 = self.connection._connection
            if type(h2) is H2Connection:
                h2.__class__ = QuietH2Connection
            if type(h2.decoder) is Decoder:
                h2.decoder.__class__ = RememberingDecoder
            if type(h2.encoder) is Encoder:
                h2.encoder.__class__ = RememberingEncoder
            # h2 caps a connection at 100 streams; above the picker's own cap, so that a
            # stream past it reaches the picker and is refused (not queued by the client)
            h2.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: 2 * max_streams})
            self.connection.flush()

    class PickerServer(Server):
        def _protocol_factory(self) -> H2Protocol:
            made = super()._protocol_factory()
            config = made.h2_config  # the server's configuration, of every connection
            config.logger = SILENT
            handler = made.handler
            if lean:
                assert isinstance(handler, Handler)
                handler = LeanHandler(handler, lean)
                # received headers in bytes: `LeanHandler.accept` decodes them for grpclib;
                # a server without ext_proc (the health port's) keeps h2's decoding
                config.header_encoding = None
            return Protocol(handler, made.config, made.h2_config)

    return PickerServer(handlers, codec=Codec())


async def start(handlers: list[Any], host: str, port: int, max_streams: int) -> tuple[Server, int]:
    """A server of `handlers` listening on host:port (0: a free one); with its port."""
    server = _server(handlers, max_streams)
    await server.start(host, port, reuse_address=True)
    sockets = server._server.sockets if server._server is not None else []
    return server, sockets[0].getsockname()[1]


async def stop(servers: Iterable[Server], grace: float, idle: Callable[[], bool]) -> None:
    """Stop accepting connections; give open streams until `idle()` or `grace` seconds,
    then end them (grpclib's `close` cancels every stream at once)."""
    servers = list(servers)
    for server in servers:
        if server._server is not None:
            server._server.close()  # the listening sockets only
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while not idle() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for server in servers:
        server.close()
    for server in servers:
        await server.wait_closed()
