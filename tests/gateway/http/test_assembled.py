"""Non-streamed requests go to replicas as streams (so the stream timeouts bound them); the
answer the gateway assembles is the one the replica gives whole: content, tool calls,
finish reasons, logprobs and usage. The replica here writes both of vLLM 0.32's shapes
from one script (a whole `model_dump_json`, and stream events with `exclude_unset`)
behind uvicorn, as vLLM's server does; the simulator's comparison is in test_engines."""

from __future__ import annotations

import json
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.fixtures.servers import ServerThread
from tests.gateway.conftest import model

USAGE = {"prompt_tokens": 21, "total_tokens": 40, "completion_tokens": 19}
# What the model generates, in the pieces it is streamed in.
CONTENT = ["Let", " me", " check", "."]
TOOLS = [
    ("chatcmpl-tool-1", "get_weather", ['{"city": ', '"Paris"', "}"]),
    ("chatcmpl-tool-2", "get_time", ['{"tz": "CET"}']),
]
TEXTS = {0: [" a", " b", " c"], 1: [" x", " y"]}  # completions, n=2


def chat_whole() -> dict[str, Any]:
    message = {
        "role": "assistant", "content": "".join(CONTENT), "refusal": None, "annotations": None,
        "audio": None, "function_call": None, "reasoning": None,
        "tool_calls": [{"id": i, "type": "function",
                        "function": {"name": name, "arguments": "".join(args)}}
                       for i, name, args in TOOLS],
    }  # fmt: skip
    return {
        "id": "chatcmpl-9", "object": "chat.completion", "created": 100, "model": "m",
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": "tool_calls", "stop_reason": None, "token_ids": None}],
        "service_tier": None, "system_fingerprint": None, "usage": USAGE,
        "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None,
    }  # fmt: skip


def chat_events() -> list[dict[str, Any]]:
    top = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 100, "model": "m"}

    def event(delta: dict[str, Any], **more: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**top, "choices": [{**choice, **more}]}

    events = [event({"role": "assistant", "content": ""})]
    events += [event({"content": piece}) for piece in CONTENT]
    for index, (ident, name, args) in enumerate(TOOLS):
        events.append(event({"tool_calls": [{"id": ident, "type": "function", "index": index,
                                             "function": {"name": name}}]}))  # fmt: skip
        events += [
            event({"tool_calls": [{"index": index, "function": {"arguments": a}}]}) for a in args
        ]
    events.append(event({}, finish_reason="tool_calls", stop_reason=None))
    return [*events, {**top, "choices": [], "usage": USAGE}]


def logprobs(pieces: list[str], offset: int = 0) -> dict[str, Any]:
    offsets = [offset + sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    return {"text_offset": offsets, "token_logprobs": [-0.25] * len(pieces), "tokens": pieces,
            "top_logprobs": [{p: -0.25} for p in pieces]}  # fmt: skip


def completions_whole() -> dict[str, Any]:
    choices = [
        {"index": i, "text": "".join(p), "logprobs": logprobs(p), "finish_reason": "length",
         "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
         "prompt_token_ids": None}
        for i, p in TEXTS.items()
    ]  # fmt: skip
    return {"id": "cmpl-4", "object": "text_completion", "created": 100, "model": "m",
            "choices": choices, "service_tier": None, "system_fingerprint": None,
            "usage": USAGE, "kv_transfer_params": None}  # fmt: skip


def completions_events() -> list[dict[str, Any]]:
    top = {"id": "cmpl-4", "object": "text_completion", "created": 100, "model": "m"}
    events = []
    for step in range(max(len(p) for p in TEXTS.values())):  # the choices interleave
        for i, pieces in TEXTS.items():
            if step < len(pieces):
                finish = "length" if step == len(pieces) - 1 else None
                offset = sum(len(p) for p in pieces[:step])
                choice = {"index": i, "text": pieces[step], "finish_reason": finish,
                          "stop_reason": None,
                          "logprobs": logprobs([pieces[step]], offset)}  # fmt: skip
                events.append({**top, "choices": [choice]})
    return [*events, {**top, "choices": [], "usage": USAGE}]


class VllmShaped:
    """A replica answering as vLLM: whole, or (asked to stream) event by event."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/chat/completions", self._answer, methods=["POST"]),
            Route("/v1/completions", self._answer, methods=["POST"]),
            Route("/metrics", lambda r: Response("", media_type="text/plain")),
        ])  # fmt: skip

    async def _answer(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        chat = request.url.path.endswith("chat/completions")
        if not body.get("stream"):
            return JSONResponse(chat_whole() if chat else completions_whole())
        events = chat_events() if chat else completions_events()
        if not (body.get("stream_options") or {}).get("include_usage"):
            events = events[:-1]

        async def stream():  # type: ignore[no-untyped-def]
            for event in events:
                yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


def test_a_non_streamed_answer_is_the_one_the_replica_gives_whole(gateway):
    replica = VllmShaped()
    server = ServerThread(replica.app()).start()
    try:
        gw = gateway({"m": model("m", [server])}, assemble_non_streamed=True)
        chat = {"model": "m", "messages": [{"role": "user", "content": "weather?"}],
                "tools": [{"type": "function", "function": {"name": "get_weather"}}]}  # fmt: skip
        completion = {"model": "m", "prompt": "p", "n": 2, "logprobs": 1, "max_tokens": 3}
        for path, body, whole in (
            ("/v1/chat/completions", chat, chat_whole()),
            ("/v1/completions", completion, completions_whole()),
        ):
            direct = httpx.post(f"{server.url}{path}", json=body, timeout=10).json()
            assert direct == whole  # the replica's own whole answer
            answer = httpx.post(f"{gw.url}{path}", json=body, timeout=10)
            assert answer.status_code == 200, answer.text
            assert answer.headers["content-type"] == "application/json"
            got = answer.json()
            sent = replica.bodies[-1]
            assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
            for key in ("id", "object", "created", "model", "usage"):
                assert got[key] == whole[key], key
            assert len(got["choices"]) == len(whole["choices"])
            for mine, theirs in zip(got["choices"], whole["choices"], strict=True):
                for key in ("index", "finish_reason", "stop_reason", "logprobs", "text"):
                    assert mine.get(key) == theirs.get(key), key
                if "message" in theirs:
                    for key in ("role", "content", "tool_calls"):
                        assert mine["message"][key] == theirs["message"][key], key
    finally:
        server.stop()


def test_with_assembly_off_a_non_streamed_request_goes_as_it_came(gateway):
    replica = VllmShaped()
    server = ServerThread(replica.app()).start()
    try:
        gw = gateway({"m": model("m", [server])}, assemble_non_streamed=False)
        body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}]}
        answer = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json() == chat_whole()  # the replica's whole answer, relayed
        assert "stream" not in replica.bodies[-1]
        assert "stream_options" not in replica.bodies[-1]
    finally:
        server.stop()
