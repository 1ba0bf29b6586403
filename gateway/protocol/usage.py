"""What a request may cost and what it cost: token counts from its body, and the `usage`
figures an upstream (a replica, the fallback API) reports, checked before anything counts
them.

- `output_bound`: the most tokens an answer may have: `max_completion_tokens` or
  `max_tokens` times its choices (`n`, `best_of`), else `DEFAULT_OUTPUT_BOUND`. A quota
  reserves prompt + this at admission (`routing/flow/quota.py`).
- `figures` / `parse`: an upstream's `usage`, or None unless both figures are whole numbers
  from 0 to `MAX_FIGURE` (a negative, infinite, fractional or boolean figure is a hostile
  or broken peer's: the gateway's own count is used instead).
- `wants_usage` / `asking_usage`: every stream the gateway accounts for asks its upstream
  for a final usage event (`stream_options.include_usage`); `UsageStrip` drops that event
  from the client's stream where the client did not ask for it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kubellm.gateway.protocol import sse

# An answer that names no max_tokens is reserved this many output tokens (engines answer
# up to the context left, which the gateway does not know); a longer answer's excess is
# charged when it ends.
DEFAULT_OUTPUT_BOUND = 4096
MAX_FIGURE = 1 << 32  # no one answer counts more tokens than this


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_FIGURE:
        return value
    return None


def output_bound(body: Mapping[str, Any] | None) -> int:
    """The most output tokens the request may be answered (see the module)."""
    body = body or {}
    choices = max((c for c in (_count(body.get("n")), _count(body.get("best_of"))) if c), default=1)
    for name in ("max_completion_tokens", "max_tokens"):
        limit = _count(body.get(name))
        if limit:
            return limit * choices
    return DEFAULT_OUTPUT_BOUND * choices


def figures(usage: object) -> dict[str, int] | None:
    """prompt and completion tokens of a `usage` object, or None where it is absent or any
    figure is not a whole number from 0 to MAX_FIGURE."""
    if not isinstance(usage, Mapping):
        return None
    prompt = _count(usage.get("prompt_tokens", 0))
    completion = _count(usage.get("completion_tokens", 0))
    if prompt is None or completion is None:
        return None
    return {"prompt": prompt, "completion": completion}


def parse(content: bytes) -> dict[str, int] | None:
    """The checked `usage` of an answer's (or an event's) JSON, or None."""
    try:
        data: Any = json.loads(content)
    except (ValueError, RecursionError):
        return None
    return figures(data.get("usage")) if isinstance(data, dict) else None


def wants_usage(body: Mapping[str, Any]) -> bool:
    """The client asked for the stream's usage event."""
    options = body.get("stream_options")
    return isinstance(options, Mapping) and options.get("include_usage") is True


def asking_usage(body: Mapping[str, Any]) -> dict[str, Any]:
    """`body` (a stream's) with `stream_options.include_usage` set: the upstream sends a
    final usage event, what the gateway settles on."""
    options = body.get("stream_options")
    options = dict(options) if isinstance(options, Mapping) else {}
    options["include_usage"] = True
    return {**body, "stream_options": options}


class UsageStrip:
    """Removes the usage the gateway asked for from a stream the client did not ask it of:
    an event with no choices and a `usage` is dropped, a `usage` beside choices is taken
    out of its event. Feed it the body's pieces; it passes the rest through unchanged,
    holding an event split across pieces until it is whole (`end` gives what is left)."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events = sse.Framer()

    def feed(self, data: bytes) -> bytes:
        if not self._events.whole(data):
            events, given_up = self._events.feed(data)
            if given_up:  # no event is this large: passed on as it is
                return events + given_up
            data = events
        if b'"usage"' not in data:
            return data
        return b"".join(_strip_event(e) for e in data.split(b"\n\n") if e)

    def end(self) -> bytes:
        return self._events.end()


def in_events(events: bytes) -> dict[str, int] | None:
    """The last `usage` (`parse`) among whole SSE events, or None."""
    found = None
    for line in events.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            figures = parse(line[6:])
            if figures is not None:
                found = figures
    return found


def _strip_event(event: bytes) -> bytes:
    """One event (without its blank line) and its blank line, the usage taken out."""
    if b'"usage"' in event and event.startswith(b"data: {"):
        try:
            data = json.loads(event[6:])
        except (ValueError, RecursionError):
            return event + b"\n\n"
        if isinstance(data, dict) and "usage" in data:
            if not data.get("choices"):
                return b""
            del data["usage"]
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
    return event + b"\n\n"
