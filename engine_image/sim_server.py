"""The simulator's HTTP face: vLLM's OpenAI API and /metrics over `sim_runtime.Simulator`.

Routes: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models,
/health, /metrics. Errors use OpenAI's envelope, with vLLM's types.

With LoRA on (the profile's max_loras > 0), requests may name a registered adapter
as their model, /v1/models lists the adapters (parent: the base model), and vLLM's
runtime adapter API is served: POST /v1/load_lora_adapter {lora_name, lora_path} and
POST /v1/unload_lora_adapter {lora_name}, with vLLM's answers (200 with a text body;
400 for a duplicate or a name that is the base model's; 404 unloading an unknown one).

Every response carries `x-kubellm-engine: simulator`, /v1/models says
`owned_by: kubellm-simulator`: nobody should mistake this for a model.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from kubellm.engine import sim_profiles as profiles
from kubellm.engine import sim_tokenizer as tokenizer
from kubellm.engine.sim_events import KVEventPublisher
from kubellm.engine.sim_runtime import RequestRejected, Simulator
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kubellm.sim_text import render_chat

OWNED_BY = "kubellm-simulator"
ENGINE_HEADER = ("x-kubellm-engine", "simulator")


class APIError(Exception):
    """An error answered in OpenAI's envelope."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        kind = {400: "BadRequestError", 404: "NotFoundError"}.get(self.status, "InternalError")
        body = {"message": self.message, "type": kind, "param": self.param, "code": self.status}
        return JSONResponse({"error": body}, status_code=self.status)


# --------------------------------------------------------------------------- OpenAI API


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is not None and (
        not isinstance(value, kind) or isinstance(value, bool) != (kind is bool)
    ):
        raise APIError(400, f"{name}: expected {getattr(kind, '__name__', kind)}", name)
    return value


def _max_tokens(body: dict[str, Any], default: int | None) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise APIError(400, f"max_tokens must be an integer >= 1, got {value!r}", "max_tokens")
    return value


async def _json_object(http: HTTPRequest) -> dict[str, Any]:
    """The request's body, which must be one JSON object (400 otherwise)."""
    try:
        body = json.loads(await http.body())
    except ValueError as error:
        raise APIError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


async def _body(http: HTTPRequest, sim: Simulator) -> dict[str, Any]:
    body = await _json_object(http)
    model = body.get("model")
    if model is not None and model != sim.served_model_name and model not in sim.adapters:
        raise APIError(404, f"The model `{model}` does not exist.", "model")
    if _field(body, "n", int, 1) != 1:
        raise APIError(400, "n: the simulator supports n=1 only", "n")
    return body


def _chat_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: expected a non-empty list", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{index}]: expected {{role, content}}", "messages")
    return render_chat(messages)


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_app(
    served_model_name: str = "sim",
    profile: str | profiles.Profile = "llama-3.1-8b-h100",
    time_scale: float = 1.0,
    *,
    block_size: int | None = None,
    num_blocks: int | None = None,
    tokenizer_dir: str | None = None,
    adapters: dict[str, str] | None = None,
    kv_events: tuple[str, int] | None = None,
    fail_prompts_over: int | None = None,
    role: str | None = None,
    kv_address: tuple[str, int] = ("127.0.0.1", 0),
) -> Starlette:
    """The simulator as an ASGI app (run it with uvicorn, or in-process via httpx).

    The stepping task starts with the first request, so ASGI transports that skip
    lifespan events work too. `kv_events` = (host, port): publish KV-cache events there
    (replay on port + 1), as vLLM's --kv-events-config does (sim_events).
    `fail_prompts_over`: misbehave on purpose, answering 500 (OpenAI's envelope) to every
    prompt longer than this many tokens (a bad revision, for a test).
    `role` (P/D, spec.prefill; vLLM's kv_transfer_params protocol, gateway/protocol/
    kv_transfer.py): "prefill" answers a request asking `do_remote_decode` with the
    `kv_transfer_params` naming its KV blocks (host and port: `kv_address`); "decode"
    takes a request carrying `do_remote_prefill` params with its prompt's KV from the
    connector (the transfer's time: the prompt's uncached KV bytes over the profile's
    `kv_link_gbps`; counted in vllm:external_prefix_cache_hits). Without a role the params
    are ignored, as vLLM without a KV connector does.
    """
    if fail_prompts_over is not None and fail_prompts_over < 1:
        raise ValueError(f"--fail-prompts-over must be at least 1, got {fail_prompts_over}")
    chosen = profiles.get(profile) if isinstance(profile, str) else profile
    chosen = chosen.with_overrides(block_size=block_size, num_blocks=num_blocks)
    publisher = KVEventPublisher(*kv_events) if kv_events else None
    sim = Simulator(
        served_model_name, chosen, time_scale, tokenizer.load(tokenizer_dir), publisher, role
    )
    if adapters and not chosen.max_loras:
        raise ValueError("adapters need LoRA on: give the profile max_loras (spec.engine.maxLoras)")
    sim.adapters.update(adapters or {})
    created = int(time.time())

    async def health(_: HTTPRequest) -> Response:
        return Response(status_code=200)

    async def models(_: HTTPRequest) -> Response:
        card = {
            "id": served_model_name, "object": "model", "created": created,
            "owned_by": OWNED_BY, "root": f"simulator:{chosen.name}", "parent": None,
            "max_model_len": chosen.max_model_len,
        }  # fmt: skip
        loras = [
            {"id": name, "object": "model", "created": created, "owned_by": OWNED_BY,
             "root": path, "parent": served_model_name, "max_model_len": None}
            for name, path in sim.adapters.items()
        ]  # fmt: skip
        return JSONResponse({"object": "list", "data": [card, *loras]})

    async def _adapter_body(http: HTTPRequest) -> dict[str, Any]:
        media = http.headers.get("content-type", "").lower().split(";", 1)[0].strip()
        if media != "application/json":  # as vLLM's validate_json_request
            raise APIError(400, "Unsupported Media Type: Only 'application/json' is allowed")
        return await _json_object(http)

    async def load_lora_adapter(http: HTTPRequest) -> Response:
        try:
            body = await _adapter_body(http)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not name or not path or not isinstance(name, str) or not isinstance(path, str):
                raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
            if name == served_model_name:
                raise APIError(
                    400, f"The lora adapter '{name}' conflicts with a served base model."
                )
            if name in sim.adapters and not body.get("load_inplace"):
                raise APIError(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True.",
                )
        except APIError as error:
            return error.response()
        # vLLM reads the adapter into host memory before it answers (add_lora)
        await sim.clock.sleep_until(sim.clock.now() + chosen.lora_load_s)
        sim.adapters[name] = path
        return Response(f"Success: LoRA adapter '{name}' added successfully.", 200)

    async def unload_lora_adapter(http: HTTPRequest) -> Response:
        try:
            body = await _adapter_body(http)
            name = body.get("lora_name")
            if not name or not isinstance(name, str):
                raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
            if name not in sim.adapters:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.")
        except APIError as error:
            return error.response()
        del sim.adapters[name]
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", 200)

    async def reset_prefix_cache(_: HTTPRequest) -> Response:
        # vLLM's (with VLLM_SERVER_DEV_MODE): 200, or 400 while blocks are in use
        if sim.engine.reset_prefix_cache():
            sim.publish_events()
            return Response(status_code=200)
        return APIError(400, "prefix cache in use: not reset").response()

    async def metrics_endpoint(_: HTTPRequest) -> Response:
        return Response(sim.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    async def complete(http: HTTPRequest, chat: bool) -> Response:
        body = await _body(http, sim)
        lora = body["model"] if body.get("model") in sim.adapters else None
        answered_as = lora or served_model_name  # vLLM answers with the adapter's name
        if chat:
            text = _chat_prompt(body.get("messages"))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
                text = None
            elif isinstance(prompt, str) and prompt:
                text = prompt
            else:
                raise APIError(400, "prompt: expected a non-empty string", "prompt")
        prompt_ids = sim.tokenizer.encode(text) if text is not None else body["prompt"]
        if not prompt_ids:
            raise APIError(400, "prompt: tokenizes to zero tokens", "prompt")
        if fail_prompts_over is not None and len(prompt_ids) > fail_prompts_over:
            raise APIError(
                500,
                f"simulated failure: a prompt of {len(prompt_ids)} tokens is over "
                f"--fail-prompts-over {fail_prompts_over}",
            )
        max_tokens = _max_tokens(body, None if not chat else sim.profile.max_model_len // 8)
        if chat and "max_tokens" not in body and "max_completion_tokens" not in body:
            max_tokens = min(max_tokens, sim.profile.max_model_len - len(prompt_ids))
        stream_mode = _field(body, "stream", bool, False)
        options = _field(body, "stream_options", dict, None) or {}
        include_usage = bool(options.get("include_usage"))
        kv_params = _field(body, "kv_transfer_params", dict, None) or {}
        remote = sim.role == "decode" and kv_params.get("do_remote_prefill") is True
        publish = sim.role == "prefill" and kv_params.get("do_remote_decode") is True
        salt = _field(body, "cache_salt", str, None) or None
        if remote and lora is None:
            reason = sim.engine.validate(len(prompt_ids), max_tokens)
            if reason:
                raise APIError(400, reason, "max_tokens")
            await sim.receive_kv(prompt_ids, salt)
        try:
            request = sim.submit(
                prompt_ids, max_tokens, streaming=stream_mode, lora=lora, cache_salt=salt,
                remote_kv=remote and lora is None,
            )  # fmt: skip
        except RequestRejected as error:
            raise APIError(400, str(error), "max_tokens") from None
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{request.request.request_id}"
        kind = "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": max_tokens,
                 "total_tokens": len(prompt_ids) + max_tokens}  # fmt: skip

        def chunk(piece: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {}
                if piece is not None:
                    delta["content"] = piece
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None,
                          "finish_reason": finish}  # fmt: skip
            return {"id": ident, "object": f"{kind}.chunk" if chat else kind,
                    "created": int(time.time()), "model": answered_as,
                    "choices": [choice]}  # fmt: skip

        if stream_mode:

            async def events() -> AsyncIterator[str]:
                # As vLLM: the chat role chunk goes out with the first token, after
                # prefill (clients that time the first chunk measure a real TTFT).
                first = chat
                async for piece in sim.tokens(request):
                    if first:
                        yield _sse(chunk(None, None, first=True))
                        first = False
                    yield _sse(chunk(piece, None))
                yield _sse(chunk(None if chat else "", "length"))
                if include_usage:
                    yield _sse({"id": ident, "object": f"{kind}.chunk" if chat else kind,
                                "created": int(time.time()), "model": answered_as,
                                "choices": [], "usage": usage})  # fmt: skip
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")
        text_out = "".join([piece async for piece in sim.tokens(request)])
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text_out},
                      "logprobs": None, "finish_reason": "length"}  # fmt: skip
        else:
            choice = {"index": 0, "text": text_out, "logprobs": None, "finish_reason": "length"}
        answer = {"id": ident, "object": kind, "created": int(time.time()),
                  "model": answered_as, "choices": [choice], "usage": usage}  # fmt: skip
        if publish:
            answer["kv_transfer_params"] = sim.kv_transfer_params(request, *kv_address)
        return JSONResponse(answer)

    def guarded(chat: bool):  # type: ignore[no-untyped-def]
        async def endpoint(http: HTTPRequest) -> Response:
            try:
                return await complete(http, chat)
            except APIError as error:
                return error.response()

        return endpoint

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        if publisher is not None:  # replay answers from the start: subscribers probe it
            publisher.start()
        yield
        await sim.stop()

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/metrics", metrics_endpoint),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            Route("/v1/completions", guarded(False), methods=["POST"]),
            Route("/v1/chat/completions", guarded(True), methods=["POST"]),
            *(
                [
                    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
                    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
                ]
                if chosen.max_loras
                else []
            ),
        ],
        lifespan=lifespan,
    )

    app.add_middleware(_MarkSimulator)
    app.state.simulator = sim
    return app


class _MarkSimulator:
    """ASGI middleware: add `x-kubellm-engine: simulator` to every HTTP response, and echo
    the request's `x-request-id`, as vLLM does with `--enable-request-id-headers` (the
    gateway checks that an answer is the one to its own request)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        request_id = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)

        async def marked(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), tuple(h.encode() for h in ENGINE_HEADER)]
                if request_id is not None:
                    headers.append((b"x-request-id", request_id))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, marked)


def banner(host: str, port: int, name: str, profile: str, time_scale: float) -> str:
    return (
        f"kubellm engine: SIMULATED engine (no model runs here) serving {name!r} on "
        f"http://{host}:{port}, profile {profile}, time scale {time_scale:g}"
    )


def describe(profile: profiles.Profile) -> str:
    """The figures a spec can change, for the start-up line."""
    return (
        f"max_num_seqs {profile.max_num_seqs}, max_model_len {profile.max_model_len}, "
        f"block_size {profile.block_size}, num_blocks {profile.num_blocks}, "
        f"max_num_batched_tokens {profile.max_num_batched_tokens}, "
        f"chunked_prefill {profile.chunked_prefill}, prefix_caching {profile.prefix_caching}"
        + (f", max_loras {profile.max_loras}" if profile.max_loras else "")
    )


def serve(
    *,
    host: str,
    port: int,
    served_model_name: str,
    profile: str | profiles.Profile,
    time_scale: float,
    block_size: int | None = None,
    num_blocks: int | None = None,
    tokenizer: str | None = None,
    adapters: dict[str, str] | None = None,
    kv_events_port: int | None = None,
    slow_steps: float | None = None,
    fail_prompts_over: int | None = None,
    role: str | None = None,
) -> int:
    """Run the simulator with uvicorn until interrupted."""
    import uvicorn

    if slow_steps is not None:
        base = profiles.get(profile) if isinstance(profile, str) else profile
        profile = base.slowed(slow_steps, "--slow-steps")
    app = create_app(
        served_model_name, profile, time_scale,
        block_size=block_size, num_blocks=num_blocks, tokenizer_dir=tokenizer,
        adapters=adapters, kv_events=(host, kv_events_port) if kv_events_port else None,
        fail_prompts_over=fail_prompts_over, role=role, kv_address=(host, port),
    )  # fmt: skip
    chosen = app.state.simulator.profile
    line = banner(host, port, served_model_name, chosen.name, time_scale)
    if slow_steps is not None or fail_prompts_over is not None:
        line += (f", MISBEHAVING on purpose (slow steps x{slow_steps or 1:g}, failing "
                 f"prompts over {fail_prompts_over or 'no'} tokens)")  # fmt: skip
    if role is not None:
        line += f", P/D {role} role (KV link {chosen.kv_link_gbps:g} GB/s)"
    if kv_events_port:
        line += f", KV events on {kv_events_port} (replay {kv_events_port + 1})"
    print(f"{line}; {describe(chosen)}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0
