"""Non-streamed answers assembled from a replica's stream.

A non-streamed request is forwarded to a replica as a stream (`streamed_body`), so the
first-byte and idle timeouts, and the retry before the first byte, bound it as they bound
a stream: a replica that freezes under it is found within seconds, not at the total
timeout. `Assembler` reads the stream's events and builds the answer the replica would
have sent whole: an OpenAI `chat.completion` or `text_completion` object.

Which requests: `assembles` says. vLLM's OpenAI server (`entrypoints/openai/`, 0.32)
answers a stream with the same content, finish reasons, tool calls, logprobs and (with
`stream_options.include_usage`) usage as the whole answer, except where a request asks
for what only the whole answer carries or what vLLM refuses to stream; those requests are
forwarded as they came (non-streamed, bounded by the total timeout only):

- `stream_options` present: vLLM refuses it without `stream` (its 400 passes on as today);
- `use_beam_search`: vLLM refuses to stream it (completions) or streams beams it cannot
  interleave;
- `best_of` other than `n` (completions): the candidates are ranked after the end;
- `prompt_logprobs`: vLLM refuses it with `stream`;
- `echo` with logprobs: the whole answer carries the prompt's logprobs (clamped) in its
  own field, the stream does not;
- `return_token_ids`, `kv_transfer_params`, `ec_transfer_params`: their answers
  (`prompt_token_ids`, transfer parameters for disaggregated serving) are the whole
  answer's only.

Each `data:` line of an event is a JSON object: choices merged by `index` (text and
message strings concatenated, the role once, tool calls merged by their `index`: id,
type and function name from their first delta, arguments concatenated; logprobs lists
concatenated; `finish_reason`, `stop_reason` and other fields: the last value given),
the answer's `id`, `created` and `model` from its first event, other top-level fields
(`system_fingerprint`, `metrics`, ...) the last value given, and `usage` from the usage
event. `[DONE]` ends it; an error event, bytes that are not an event, or an end before
`[DONE]` fail it (`AssemblyError`): the client gets an error, never half an answer.

`[DONE]` is the end: the caller stops reading there (`done`) and closes that connection
(a replica that sends the answer and `[DONE]` but leaves the response open is answered at
once, and its connection is never reused).

Bounded, as a replica may be hostile: choices by the request's (`choices_of`: `n`, times
the prompts of a completions request), tool calls by `MAX_TOOL_CALLS` per choice, one
event by `MAX_EVENT_BYTES` (far below the answer's limit: a vLLM event is one token's
delta), and what is kept at most `limit` bytes counted as Python holds it: each string
piece its length plus `OBJECT_BYTES`, each new choice or tool call `OBJECT_BYTES`, each
decoded value kept (logprobs, other fields) `EXPANSION` times the event it came in; the
answer written at most `limit` bytes too. Past any bound, `AssemblyError`.
"""

from __future__ import annotations

import json
from typing import Any

from kubellm.gateway.protocol.openai import CHAT, COMPLETIONS

_WHOLE_ONLY = ("return_token_ids", "kv_transfer_params", "ec_transfer_params")
_FIRST = frozenset(("id", "created", "model"))  # the answer's, from its first event
_SKIPPED = frozenset(("choices", "object"))
_CHOICE_OWN = frozenset(("index", "text", "delta"))  # a choice's, never a field of the answer
_decode = json.JSONDecoder().raw_decode  # str in: json.loads's bytes sniffing skipped
MAX_EVENT_BYTES = 1024 * 1024  # one event (vLLM's: one token's delta, its logprobs)
MAX_TOOL_CALLS = 128  # tool calls per choice (their indices: 0 to 127)
OBJECT_BYTES = 64  # what one more Python object (a string piece, a dict) costs, about
EXPANSION = 8  # decoded JSON held as Python objects: bytes per byte of the event, about


def choices_of(body: dict[str, Any], path: str) -> int:
    """How many choices the answer to `body` has: `n` (vLLM: at most 1 without it), times
    the prompts of a completions request (a list of strings or of token-id lists)."""
    n = body.get("n")
    count = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompt = body.get("prompt") if path == COMPLETIONS else None
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        count *= len(prompt)
    return count


def assembles(body: dict[str, Any], path: str) -> bool:
    """Whether the non-streamed request `body` to `path` is sent to a replica as a stream
    and its answer assembled here (see the module for the exceptions and why)."""
    if path not in (CHAT, COMPLETIONS) or body.get("stream") is True:
        return False
    if "stream_options" in body or body.get("use_beam_search"):
        return False
    if body.get("prompt_logprobs") is not None or any(body.get(k) for k in _WHOLE_ONLY):
        return False
    logprobs = body.get("logprobs")
    if body.get("echo") and logprobs is not None and logprobs is not False:
        return False
    if path == COMPLETIONS:
        best_of = body.get("best_of")
        if best_of is not None and best_of != (body.get("n") or 1):
            return False
    return True


_STREAM_FIELDS = b',"stream":true,"stream_options":{"include_usage":true}}'


def streamed_body(body: dict[str, Any], raw: bytes | None = None) -> bytes:
    """The request to send the replica: `body` as a stream with a final usage event.
    `raw`: the bytes `body` was parsed from; when `body` has neither field they are
    appended to them (no re-encoding: the object's closing brace replaced)."""
    if raw is not None and "stream" not in body:  # `stream_options` is never assembled
        end = raw.rstrip()
        if end.endswith(b"}"):
            return end[:-1] + _STREAM_FIELDS
    outgoing = dict(body)
    outgoing["stream"] = True
    outgoing["stream_options"] = {"include_usage": True}
    return json.dumps(outgoing, ensure_ascii=False, separators=(",", ":")).encode()


class AssemblyError(Exception):
    """The stream gives no whole answer (the reason is the exception's message)."""


class _Choice:
    """One choice being assembled."""

    __slots__ = ("fields", "logprobs", "message", "strings", "text", "tools")

    def __init__(self) -> None:
        self.text: list[str] = []  # completions
        self.strings: dict[str, list[str]] = {}  # chat: the message's string fields
        self.message: dict[str, Any] = {}  # chat: the message's other fields
        self.tools: dict[int, list[Any]] = {}  # chat: index -> [id, type, name, [arguments]]
        self.logprobs: dict[str, Any] | None = None
        self.fields: dict[str, Any] = {"finish_reason": None}  # the choice's other fields


class Assembler:
    """Feed it a replica's SSE body (`feed`, as the pieces arrive) until `done`; `answer` is
    the whole answer's JSON once the stream ended. `chat`: a chat completion (else a
    completion); `choices`: how many the answer may have (`choices_of`)."""

    def __init__(self, chat: bool, limit: int, choices: int = 1) -> None:
        self.chat = chat
        self.limit = limit
        self.choices = choices
        self.event_limit = min(limit, MAX_EVENT_BYTES)
        self.done = False  # `[DONE]` arrived
        self.events = 0
        self._pending: list[bytes] = []  # the pieces of an incomplete line
        self._data: list[bytes] = []  # the data lines of the event being read
        self._data_size = 0
        self._pending_size = 0
        self._kept = 0
        self._retained = False  # the event being read left a value other than text kept
        self._top: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._usage: Any = None

    # ------------------------------------------------------------ reading

    def feed(self, data: bytes) -> None:
        """Take the next piece of the body: lines end with LF (a CR before it is dropped),
        an event with an empty line; `data:` lines are kept, comments and other fields
        ignored, as the SSE format says. An event cut off by the end is no event; nothing
        after `[DONE]` is read."""
        if self.done:
            return
        if (  # the usual piece: whole one-line events (one HTTP chunk, or one read's)
            not self._pending
            and not self._data
            and data.endswith(b"\n\n")
            and data.startswith(b"data: ")
        ):
            if data.count(b"\n") == 2 and len(data) <= self.event_limit:
                self._event(data[6:-2])
                return
            events = data[:-2].split(b"\n\n")
            for position, event in enumerate(events):
                if (
                    event.startswith(b"data: ")
                    and b"\n" not in event
                    and len(event) <= self.event_limit
                ):
                    self._event(event[6:])
                    if self.done:
                        return
                else:  # anything else: read line by line from here
                    data = b"\n\n".join(events[position:]) + b"\n\n"
                    break
            else:
                return
        if b"\n" not in data:  # part of a line: kept until its end (linear, however cut)
            self._pending.append(data)
            self._pending_size += len(data)
            self._check_event()
            return
        if self._pending:
            data = b"".join(self._pending) + data
            self._pending = []
        lines = data.split(b"\n")
        last = lines.pop()
        if last:
            self._pending.append(last)
        self._pending_size = len(last)
        for line in lines:
            if self.done:
                break
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    event, self._data, self._data_size = b"\n".join(self._data), [], 0
                    self._event(event)
            elif line.startswith(b"data:"):
                value = line[5:]
                value = value[1:] if value.startswith(b" ") else value
                self._data.append(value)
                self._data_size += len(value)
                self._check_event()
        self._check_event()

    def _check_event(self) -> None:
        if self._pending_size + self._data_size > self.event_limit:
            raise AssemblyError(f"an event exceeds the limit of {self.event_limit} bytes")

    def _event(self, data: bytes) -> None:
        if self.done:
            return  # nothing counts after the end
        if data == b"[DONE]":
            self.done = True
            return
        try:
            text = data.decode().strip()
            event, end = _decode(text)
            if end != len(text):
                raise ValueError("data after the JSON value")
        except (ValueError, RecursionError):  # UnicodeDecodeError too
            raise AssemblyError("the replica sent an event that is not JSON") from None
        if not isinstance(event, dict):
            raise AssemblyError("the replica sent an event that is not a JSON object")
        if "error" in event or event.get("object") == "error":
            raise AssemblyError("the replica reported an error mid-answer")
        self.events += 1
        self._retained = False
        choices = event.get("choices")
        if choices:
            if not isinstance(choices, list):
                raise AssemblyError("the replica sent `choices` that is not a list")
            for position, choice in enumerate(choices):
                if not isinstance(choice, dict):
                    raise AssemblyError("the replica sent a choice that is not an object")
                self._choice(choice, position)
        top = self._top
        for key, value in event.items():
            if key in _SKIPPED:
                continue
            if key in _FIRST:
                if key not in top:
                    top[key], self._retained = value, True
            elif key == "usage":
                if value is not None:
                    self._usage, self._retained = value, True
            else:
                self._set(top, key, value)
        if self._retained:  # what it left: at most its own decoded size
            self._keep(EXPANSION * len(data))

    def _set(self, fields: dict[str, Any], key: str, value: Any) -> None:
        """A field whose last value counts (a null never replaces a value)."""
        if value is not None:
            fields[key], self._retained = value, True
        elif key not in fields:
            fields[key], self._retained = None, True

    def _choice(self, given: dict[str, Any], position: int) -> None:
        index = given.get("index", position)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise AssemblyError("the replica sent a choice without a valid `index`")
        choice = self._choices.get(index)
        if choice is None:
            if index >= self.choices:
                raise AssemblyError(
                    f"the replica sent choice {index} of an answer of {self.choices}"
                )
            choice = self._choices[index] = _Choice()
            self._keep(OBJECT_BYTES)
        fields = choice.fields
        for key, value in given.items():
            if value is None:  # most fields of most events: a null never replaces a value
                if key not in fields and key not in _CHOICE_OWN:
                    fields[key], self._retained = None, True
            elif key == "index":
                continue
            elif key == "text" and not self.chat:
                if isinstance(value, str):
                    self._keep(len(value) + OBJECT_BYTES)
                    choice.text.append(value)
            elif key == "delta" and self.chat:
                if isinstance(value, dict):
                    self._delta(choice, value)
            elif key == "logprobs":
                if isinstance(value, dict):
                    choice.logprobs = _merge_lists(choice.logprobs, value)
                    self._retained = True
            else:
                fields[key], self._retained = value, True

    def _delta(self, choice: _Choice, delta: dict[str, Any]) -> None:
        for key, value in delta.items():
            if key == "role":
                if isinstance(value, str) and value and "role" not in choice.message:
                    choice.message["role"], self._retained = value, True
            elif key == "tool_calls":
                if isinstance(value, list):
                    for position, call in enumerate(value):
                        if isinstance(call, dict):
                            self._tool_call(choice, call, position)
            elif isinstance(value, str):
                self._keep(len(value) + OBJECT_BYTES)
                choice.strings.setdefault(key, []).append(value)
            else:
                self._set(choice.message, key, value)

    def _tool_call(self, choice: _Choice, call: dict[str, Any], position: int) -> None:
        index = call.get("index", position)
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < MAX_TOOL_CALLS:
            raise AssemblyError("the replica sent a tool call without a valid `index`")
        tool = choice.tools.get(index)
        if tool is None:
            tool = choice.tools[index] = [None, None, None, []]
            self._keep(4 * OBJECT_BYTES)
        for slot, value in ((0, call.get("id")), (1, call.get("type"))):
            if tool[slot] is None and isinstance(value, str) and value:
                tool[slot], self._retained = value, True
        function = call.get("function")
        if isinstance(function, dict):
            name, arguments = function.get("name"), function.get("arguments")
            if tool[2] is None and isinstance(name, str) and name:
                tool[2], self._retained = name, True
            if isinstance(arguments, str) and arguments:
                self._keep(len(arguments) + OBJECT_BYTES)
                tool[3].append(arguments)

    def _keep(self, size: int) -> None:
        self._kept += size
        if self._kept > self.limit:
            raise AssemblyError(f"the answer exceeds the limit of {self.limit} bytes")

    # ------------------------------------------------------------ the answer

    def answer(self) -> bytes:
        """The whole answer's JSON; `AssemblyError` when the stream did not end whole."""
        if not self.done:
            raise AssemblyError("the replica's stream ended before its end (`[DONE]`)")
        if not self._choices:
            raise AssemblyError("the replica's stream carried no choice")
        top = self._top
        out: dict[str, Any] = {
            "id": top.get("id"),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": top.get("created"),
            "model": top.get("model"),
            "choices": [self._render(i, c) for i, c in sorted(self._choices.items())],
        }
        for key, value in top.items():
            out.setdefault(key, value)
        if self._usage is not None:
            out["usage"] = self._usage
        content = json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()
        if len(content) > self.limit:
            raise AssemblyError(f"the answer exceeds the limit of {self.limit} bytes")
        return content

    def _render(self, index: int, choice: _Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index}
        if self.chat:
            message: dict[str, Any] = {"role": choice.message.get("role", "assistant")}
            parts = choice.strings.get("content")
            content = None if parts is None else "".join(parts)
            message["content"] = None if content == "" and choice.tools else content
            for key, parts in choice.strings.items():
                message.setdefault(key, "".join(parts))
            for key, value in choice.message.items():
                message.setdefault(key, value)
            if choice.tools:
                message["tool_calls"] = [
                    {
                        "id": tool[0],
                        "type": tool[1] or "function",
                        "function": {"name": tool[2], "arguments": "".join(tool[3])},
                    }
                    for _, tool in sorted(choice.tools.items())
                ]
            out["message"] = message
        else:
            out["text"] = "".join(choice.text)
        if choice.logprobs is not None:
            out["logprobs"] = choice.logprobs
        for key, value in choice.fields.items():
            out.setdefault(key, value)
        return out


def _merge_lists(merged: dict[str, Any] | None, given: dict[str, Any]) -> dict[str, Any]:
    """Logprobs of one more event: lists are concatenated, other values the last given."""
    out = {} if merged is None else merged
    for key, value in given.items():
        if isinstance(value, list):
            kept = out.get(key)
            if isinstance(kept, list):
                kept.extend(value)
            else:
                out[key] = list(value)
        elif value is not None or key not in out:
            out[key] = value
    return out
