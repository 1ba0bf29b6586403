"""`kubellm gateway` serves on uvloop's event loop when it is installed (issue 38's proxy
cost: `asyncio.run(server.serve(...))` had left the gateway on asyncio's loop, which costs
more per request), asyncio's when KUBELLM_GATEWAY_LOOP=asyncio."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kubellm.gateway import cli
from kubellm.gateway.http import server


def _serving_loop(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> type:
    """The class of the event loop `kubellm gateway` serves on (its servers stop at once)."""
    seen: list[type] = []

    async def serve(servers: list) -> None:
        seen.append(type(asyncio.get_running_loop()))

    monkeypatch.setattr(server, "serve", serve)
    static = tmp_path / "static.yaml"
    static.write_text("models:\n- name: m\n  endpoints: ['http://127.0.0.1:9']\n")
    assert cli.main(["--port", "0", "--static", str(static)]) == 0
    assert len(seen) == 1
    return seen[0]


def test_the_gateway_serves_on_uvloop_unless_told_asyncio(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.delenv("KUBELLM_GATEWAY_LOOP", raising=False)
    assert issubclass(_serving_loop(monkeypatch, tmp_path), uvloop.Loop)
    monkeypatch.setenv("KUBELLM_GATEWAY_LOOP", "asyncio")
    assert not issubclass(_serving_loop(monkeypatch, tmp_path), uvloop.Loop)
