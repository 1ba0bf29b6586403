"""Server-sent events as an OpenAI-compatible server streams them: the one place the
gateway cuts a stream's pieces into whole events (`Framer`), bounded.

An event ends at a blank line; a piece of the body may end mid-event, so its start is
carried to the next piece, up to `MAX_EVENT_BYTES` (no event of an answer is this large:
past it the carry is given up). No SSE parser among the dependencies reads bytes pushed
piece by piece from a relay (httpx-sse and aiohttp-sse-client own the connection), and the
usual piece is one whole event, which passes with one test. The assembler of non-streamed
answers (`assemble.py`) reads every line of every event, bounded on its own.
"""

from __future__ import annotations

MAX_EVENT_BYTES = 64 * 1024
DATA = b"data: "


class Framer:
    """Whole events from a stream's pieces (see the module)."""

    __slots__ = ("carry",)

    def __init__(self) -> None:
        self.carry = b""

    def whole(self, data: bytes) -> bool:
        """`data` is whole events with nothing carried: it needs no `feed`."""
        return not self.carry and data.endswith(b"\n\n")

    def feed(self, data: bytes) -> tuple[bytes, bytes]:
        """(the whole events `data` completes, with their blank lines; what was given up:
        an event's start longer than MAX_EVENT_BYTES, else b"")."""
        events, sep, carry = (self.carry + data).rpartition(b"\n\n")
        if len(carry) > MAX_EVENT_BYTES:
            self.carry = b""
            return events + sep, carry
        self.carry = carry
        return events + sep, b""

    def end(self) -> bytes:
        """What is carried (an event the stream never finished), and nothing after it."""
        carry, self.carry = self.carry, b""
        return carry
