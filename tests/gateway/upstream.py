"""Small OpenAI-compatible upstream servers for gateway tests (and benchmarks).

`FakeEngine` answers `/v1/chat/completions` and `/v1/completions` (SSE or
JSON), `/v1/models`, `/health` and a vLLM-named `/metrics`. Its `behaviour`
can be changed while it runs: slow first byte, slow tokens, an error status,
death mid-stream, and the queue/KV figures its metrics report. It records the
bodies it received and how many streams were cut off by the client.
(`tests.fixtures.servers.ServerThread` serves them on loopback.)
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Behaviour:
    status: int = 200
    first_byte_delay: float = 0.0
    tokens: int = 4
    token_delay: float = 0.0
    die_after_tokens: int | None = None
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    metrics_status: int = 200
    # a prefill leg's answer (kv_transfer_params.do_remote_decode): "params" as vLLM's
    # NixlConnector answers, "garbage" (not JSON), "none" (no params)
    prefill_answer: str = "params"
    # vLLM's token counters on /metrics: None (not exported), "still" (a replica making no
    # progress), "moving" (advancing at each scrape)
    token_counters: str | None = None


@dataclass
class FakeEngine:
    name: str
    behaviour: Behaviour = field(default_factory=Behaviour)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    active: int = 0
    cancelled: int = 0
    completed: int = 0
    scrapes: int = 0

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/chat/completions", self._complete, methods=["POST"]),
                Route("/completions", self._complete, methods=["POST"]),
                Route("/v1/models", self._models),
                Route("/health", self._health),
                Route("/metrics", self._metrics),
            ]
        )

    async def _health(self, request: Request) -> Response:
        return JSONResponse({})

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def _metrics(self, request: Request) -> Response:
        b = self.behaviour
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {b.waiting}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {b.running + self.active}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {b.kv_usage}\n'
        )
        if b.token_counters is not None:
            self.scrapes += 1
            moved = self.scrapes if b.token_counters == "moving" else 1
            text += (
                "# TYPE vllm:prompt_tokens counter\n"
                f'vllm:prompt_tokens_total{{model_name="m"}} 100\n'
                "# TYPE vllm:generation_tokens counter\n"
                f'vllm:generation_tokens_total{{model_name="m"}} {moved}\n'
            )
        return Response(text, status_code=b.metrics_status, media_type="text/plain")

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        b = self.behaviour
        if b.first_byte_delay:
            await asyncio.sleep(b.first_byte_delay)
        if b.status != 200:
            return JSONResponse(
                {"error": {"message": "engine says no", "type": "server_error",
                           "param": None, "code": None}},
                status_code=b.status,
            )  # fmt: skip
        chat = request.url.path.endswith("chat/completions")
        model = body.get("model", self.name)
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            self.completed += 1
            return self._prefilled(model, chat, b.prefill_answer)
        if not body.get("stream"):
            self.completed += 1
            return JSONResponse(_completion(model, chat, self.name, b.tokens))
        options = body.get("stream_options") or {}
        usage = bool(options.get("include_usage"))
        events = self._stream(model, chat, b, usage)
        return StreamingResponse(events, media_type="text/event-stream")

    def _prefilled(self, model: str, chat: bool, answer: str) -> Response:
        """A prefill engine's answer: one token, and the params naming its KV blocks."""
        if answer == "garbage":
            return Response(b"\x00not json{", media_type="application/json")
        whole = _completion(model, chat, self.name, 1)
        if answer == "params":
            whole["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.name, "remote_block_ids": [0, 1, 2],
                "remote_request_id": f"{self.name}-r{self.completed}",
                "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
            }  # fmt: skip
        return JSONResponse(whole)

    async def _stream(self, model: str, chat: bool, b: Behaviour, usage: bool):  # type: ignore[no-untyped-def]
        """As vLLM streams: the last token's event carries the finish reason, and a usage
        event (the whole answer's usage) follows when `stream_options.include_usage`."""
        self.active += 1
        done = False
        try:
            for i in range(b.tokens):
                if b.die_after_tokens is not None and i >= b.die_after_tokens:
                    raise RuntimeError("engine died mid-stream")
                if b.token_delay and i:
                    await asyncio.sleep(b.token_delay)
                event = _chunk(model, chat, f"{self.name}-t{i} ")
                if i == b.tokens - 1:
                    event["choices"][0]["finish_reason"] = "stop"
                yield "data: " + json.dumps(event) + "\n\n"
            if usage:
                whole = _completion(model, chat, self.name, b.tokens)
                event = {k: whole[k] for k in ("id", "created", "model", "usage")}
                event.update(object=_chunk(model, chat, "")["object"], choices=[])
                yield "data: " + json.dumps(event) + "\n\n"
            yield "data: [DONE]\n\n"
            done = True
            self.completed += 1
        finally:
            self.active -= 1
            if not done and b.die_after_tokens is None:
                self.cancelled += 1


def _completion(model: str, chat: bool, who: str, tokens: int) -> dict[str, Any]:
    text = " ".join(f"{who}-t{i}" for i in range(tokens))
    usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
    if chat:
        return {
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": usage,
        }  # fmt: skip
    return {
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
        "usage": usage,
    }  # fmt: skip


def _chunk(model: str, chat: bool, text: str) -> dict[str, Any]:
    if chat:
        return {
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        }  # fmt: skip
    return {
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}],
    }  # fmt: skip
