"""A non-streamed answer assembled from a replica's stream is the answer it would have sent
whole; what cannot be assembled fails, bounded, and never gives half an answer.

The events are shaped as vLLM 0.32's OpenAI server writes them (`model_dump_json` with
`exclude_unset`: a role event first, `finish_reason` on the last token's event, a usage
event with no choices when `stream_options.include_usage`, then `[DONE]`)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubellm.gateway.protocol.assemble import (
    MAX_EVENT_BYTES,
    MAX_TOOL_CALLS,
    Assembler,
    AssemblyError,
    assembles,
    choices_of,
    streamed_body,
)
from kubellm.gateway.protocol.openai import CHAT, COMPLETIONS

LIMIT = 1024 * 1024
TOP = {"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 17, "model": "m"}
USAGE = {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4}


def sse(*events: dict[str, Any] | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def chat_event(delta: dict[str, Any], finish: str | None = None, index: int = 0, **more: Any):
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, **more}
    return {**TOP, "choices": [choice]}


def usage_event(top: dict[str, Any] = TOP) -> dict[str, Any]:
    return {**top, "choices": [], "usage": USAGE}


def assemble(
    body: bytes, chat: bool = True, limit: int = LIMIT, piece: int = 0, choices: int = 2
) -> Any:
    assembler = Assembler(chat, limit, choices)
    pieces = [body[i : i + piece] for i in range(0, len(body), piece)] if piece else [body]
    for part in pieces:
        assembler.feed(part)
    return json.loads(assembler.answer())


def test_a_chat_stream_gives_the_whole_answer():
    body = sse(
        chat_event({"role": "assistant", "content": ""}),
        chat_event({"content": "Hello"}, token_ids=None),
        chat_event({"content": ", wor"}, token_ids=None),
        chat_event({"content": "ld"}, "stop", stop_reason=None, token_ids=None),
        usage_event(),
        "[DONE]",
    )
    answer = assemble(body)
    assert answer == {
        "id": "chatcmpl-7", "object": "chat.completion", "created": 17, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello, world"},
                     "logprobs": None, "finish_reason": "stop", "stop_reason": None,
                     "token_ids": None}],
        "usage": USAGE,
    }  # fmt: skip


def test_tool_calls_are_merged_by_their_index():
    """Two parallel calls, their argument pieces interleaved: each gets its id, type and
    name from its first delta and its arguments concatenated (vLLM's hermes parser)."""

    def call(index: int, **fields: Any) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, **fields}]}

    body = sse(
        chat_event({"role": "assistant", "content": ""}),
        chat_event(call(0, id="call-a", type="function", function={"name": "weather"})),
        chat_event(call(0, function={"arguments": '{"city": '})),
        chat_event(call(1, id="call-b", type="function", function={"name": "time"})),
        chat_event(call(1, function={"arguments": '{"tz": "CET"}'})),
        chat_event(call(0, function={"arguments": '"Paris"}'})),
        chat_event({}, "tool_calls"),
        usage_event(),
        "[DONE]",
    )
    (choice,) = assemble(body)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,  # as vLLM's whole answer when the model only called tools
        "tool_calls": [
            {"id": "call-a", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call-b", "type": "function",
             "function": {"name": "time", "arguments": '{"tz": "CET"}'}},
        ],
    }  # fmt: skip


def test_completion_choices_come_by_index_with_their_logprobs_concatenated():
    top = {"id": "cmpl-3", "object": "text_completion", "created": 5, "model": "m"}

    def event(index: int, text: str, tokens: list[str], finish: str | None = None):
        logprobs = {"text_offset": [0] * len(tokens), "token_logprobs": [-0.5] * len(tokens),
                    "tokens": tokens, "top_logprobs": [{t: -0.5} for t in tokens]}  # fmt: skip
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": None}  # fmt: skip
        return {**top, "choices": [choice]}

    body = sse(
        event(1, "b1", ["b1"]),
        event(0, "a1", ["a1"]),
        event(0, " a2", [" a", "2"], "length"),
        event(1, " b2", [" b2"], "stop"),
        usage_event(top),
        "[DONE]",
    )
    answer = assemble(body, chat=False)
    assert answer["object"] == "text_completion" and answer["id"] == "cmpl-3"
    first, second = answer["choices"]
    assert (first["index"], first["text"], first["finish_reason"]) == (0, "a1 a2", "length")
    assert (second["index"], second["text"], second["finish_reason"]) == (1, "b1 b2", "stop")
    assert first["logprobs"]["tokens"] == ["a1", " a", "2"]
    assert first["logprobs"]["top_logprobs"] == [{"a1": -0.5}, {" a": -0.5}, {"2": -0.5}]
    assert len(first["logprobs"]["text_offset"]) == 3 and answer["usage"] == USAGE


def test_however_the_bytes_are_cut_the_answer_is_the_same():
    events = [chat_event({"role": "assistant", "content": ""})]
    events += [chat_event({"content": f"é{i} "}) for i in range(20)]
    events += [chat_event({}, "length"), usage_event(), "[DONE]"]
    body = sse(*events)
    whole = assemble(body)
    assert whole["choices"][0]["message"]["content"] == "".join(f"é{i} " for i in range(20))
    for piece in (1, 2, 7, 64):
        assert assemble(body, piece=piece) == whole
    assert assemble(body.replace(b"\n", b"\r\n")) == whole  # CRLF lines, as SSE allows
    commented = b": keep-alive\n\n" + body.replace(b"data: ", b"data:", 3)
    assert assemble(commented) == whole  # comments ignored; the space after `data:` optional


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(sse(chat_event({"content": "x"})), id="no [DONE]"),
        pytest.param(sse(chat_event({"content": "x"})) + b"data: [DONE]", id="[DONE] cut off"),
        pytest.param(sse(chat_event({"content": "x"}))[:-5], id="cut mid-event"),
        pytest.param(
            sse(chat_event({"content": "x"}), {"error": {"message": "boom"}}, "[DONE]"),
            id="vLLM's error event",
        ),
        pytest.param(sse(chat_event({"content": "x"}), "{not json", "[DONE]"), id="not JSON"),
        pytest.param(sse('["a list"]', "[DONE]"), id="not an object"),
        pytest.param(sse(usage_event(), "[DONE]"), id="no choice"),
        pytest.param(sse({**TOP, "choices": [{"index": -1}]}, "[DONE]"), id="bad index"),
    ],
)
def test_a_stream_that_gives_no_whole_answer_fails(body):
    with pytest.raises(AssemblyError):
        assemble(body)


def test_what_is_kept_is_bounded():
    pieces = [chat_event({"content": "x" * 1000}) for _ in range(20)]
    with pytest.raises(AssemblyError, match="exceeds the limit"):
        assemble(sse(*pieces, "[DONE]"), limit=10_000)
    assembler = Assembler(True, 10_000)
    with pytest.raises(AssemblyError, match="exceeds the limit"):
        for _ in range(1000):  # one endless line, in small pieces: refused past the limit
            assembler.feed(b"data: " + b"y" * 100)
    assembler = Assembler(True, 10_000)
    with pytest.raises(AssemblyError, match="exceeds the limit"):
        for _ in range(1000):  # an event that never ends
            assembler.feed(b"data: " + b"z" * 100 + b"\n")
    many = [{**TOP, "choices": [{"index": 0, "delta": {"x": i}}]} for i in range(200)]
    with pytest.raises(AssemblyError, match="exceeds the limit"):
        assemble(sse(*many, "[DONE]"), limit=10_000)  # decoded values cost what they hold


def test_choices_tool_calls_and_events_are_bounded_whatever_the_limit():
    """Issue 39.18: choices beyond the request's, tool calls beyond MAX_TOOL_CALLS and an
    event beyond MAX_EVENT_BYTES fail at once, however large the answer's limit."""
    big = 1 << 30
    many = [{**TOP, "choices": [{"index": i, "delta": {"content": "a"}}]} for i in range(3)]
    with pytest.raises(AssemblyError, match="choice 2 of an answer of 2"):
        assemble(sse(*many, "[DONE]"), limit=big)
    calls = [chat_event({"tool_calls": [{"index": MAX_TOOL_CALLS, "function": {"name": "f"}}]})]
    with pytest.raises(AssemblyError, match="tool call"):
        assemble(sse(*calls, "[DONE]"), limit=big)
    huge = chat_event({"content": "x" * MAX_EVENT_BYTES})
    for piece in (0, 65536):
        with pytest.raises(AssemblyError, match="an event exceeds"):
            assemble(sse(huge, "[DONE]"), limit=big, piece=piece)
    assert assemble(sse(chat_event({"content": "x" * 1000}), "[DONE]"), choices=1)


def test_nothing_after_done_is_read():
    """Issue 39.19: `[DONE]` is the end; the caller stops there (`done`), whatever follows."""
    assembler = Assembler(True, LIMIT)
    assembler.feed(sse(chat_event({"content": "x"}), "[DONE]") + b"data: {not json\n\n")
    assert assembler.done
    assembler.feed(b"garbage that is never parsed\n\n")
    assert json.loads(assembler.answer())["choices"][0]["message"]["content"] == "x"


@pytest.mark.parametrize(
    ("path", "body", "count"),
    [
        (CHAT, {"messages": []}, 1),
        (CHAT, {"n": 3}, 3),
        (COMPLETIONS, {"prompt": "x", "n": 2}, 2),
        (COMPLETIONS, {"prompt": [1, 2, 3], "n": 2}, 2),  # one prompt of token ids
        (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2}, 6),
        (COMPLETIONS, {"prompt": [[1], [2]]}, 2),
        (CHAT, {"n": "9"}, 1),
    ],
)
def test_the_choices_an_answer_has(path, body, count):
    assert choices_of(body, path) == count


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        (CHAT, {"messages": []}, True),
        (CHAT, {"stream": False, "n": 2, "tools": [], "logprobs": True}, True),
        (COMPLETIONS, {"prompt": "x", "best_of": 2, "n": 2}, True),
        (COMPLETIONS, {"prompt": "x", "echo": True}, True),
        (CHAT, {"stream": True}, False),  # streamed already
        (CHAT, {"stream_options": {"include_usage": True}}, False),  # vLLM's 400 passes on
        (CHAT, {"use_beam_search": True}, False),
        (COMPLETIONS, {"prompt": "x", "best_of": 3}, False),
        (COMPLETIONS, {"prompt": "x", "best_of": 3, "n": 2}, False),
        (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1}, False),
        (COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": 0}, False),
        (CHAT, {"echo": True, "logprobs": True}, False),
        (CHAT, {"return_token_ids": True}, False),
        (CHAT, {"kv_transfer_params": {"do_remote_decode": True}}, False),
        ("/v1/embeddings", {"input": "x"}, False),
    ],
)
def test_which_requests_are_sent_as_streams(path, body, expected):
    assert assembles(body, path) is expected


def test_the_request_sent_is_a_stream_with_a_usage_event():
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo"}], "top_k": 3}
    sent = json.loads(streamed_body(body))
    assert sent == {**body, "stream": True, "stream_options": {"include_usage": True}}
    assert "stream" not in body  # the client's body is not changed


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": "h\\u00e9llo"}], "top_k": 3}',
        '{"model":"m","messages":[{"role":"user","content":"héllo"}],"top_k":3} \n'.encode(),
        b'{"model":"m","messages":[{"role":"user","content":"h\xc3\xa9llo"}],"top_k":3,'
        b'"stream":false}',
    ],
)
def test_the_request_sent_from_the_clients_bytes_is_the_same_request(raw):
    """The stream fields are appended to the client's bytes when it set neither (no
    re-encoding); the replica reads the same request as from a re-encoded body."""
    body = json.loads(raw)
    sent = streamed_body(body, raw)
    assert json.loads(sent) == {**body, "stream": True, "stream_options": {"include_usage": True}}
    if "stream" in body:  # set by the client: re-encoded, never a repeated key
        assert sent == streamed_body(body)
