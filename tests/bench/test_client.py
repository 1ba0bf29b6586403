"""bench/_client.py, the benchmarks' one streamed client, against the simulated engine:
every text event counted and timed, chat and completions alike; a refusal and a dead peer
come back as `ok: False` with why."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from bench import _client
from tests.fixtures.engines import free_port


def stream(url: str, body: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=60.0) as client:
            return await _client.stream(client, url, body, **kwargs)

    return asyncio.run(go())


def test_a_chat_and_a_completion_are_timed_token_by_token(
    sim_server: Callable[..., str],
) -> None:
    url = sim_server(served_model_name="sim")
    chat = stream(url, {"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 5, "ignore_eos": True})  # fmt: skip
    assert chat["ok"], chat
    assert chat["tokens"] == 5 and chat["text"]
    assert chat["ttft"] >= 0 and chat["itl"] >= 0
    done = stream(url, {"model": "sim", "prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                  path="/v1/completions")  # fmt: skip
    assert done["ok"] and done["tokens"] == 3, done


def test_a_refusal_and_a_dead_peer_say_why(sim_server: Callable[..., str]) -> None:
    url = sim_server(served_model_name="sim")
    refused = stream(url, {"model": "other", "messages": [{"role": "user", "content": "hi"}]})
    assert not refused["ok"] and refused["status"] == 404
    assert refused["response"].json()["error"]["message"]
    dead = stream(f"http://127.0.0.1:{free_port()}", {"model": "sim", "prompt": "hi"})
    assert dead == {"ok": False, "status": "ConnectError"}


def test_text_of_reads_both_shapes_and_nothing_else() -> None:
    assert _client.text_of('{"choices": [{"delta": {"content": "a"}}]}') == "a"
    assert _client.text_of('{"choices": [{"text": "b"}]}') == "b"
    assert _client.text_of('{"choices": [{"delta": {"role": "assistant"}}]}') == ""
    assert _client.text_of("[DONE]") == ""
    assert _client.text_of('{"choices": [], "usage": {"completion_tokens": 3}}') == ""
