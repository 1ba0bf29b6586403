"""`kubellm up` serves a manifest's LoRA adapters, and a manifest edit that adds one loads it
on the running replicas: the same processes answer (no restart)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.fixtures.engines import wait_until
from tests.fixtures.fleets import write_manifest


def _chat(url: str, model: str) -> httpx.Response:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_adapters_are_served_and_an_added_one_loads_without_a_restart(
    start_fleet: Any, tmp_path: Path
) -> None:
    spec: dict[str, Any] = {
        "model": {"source": "file:///nonexistent/sim-only", "servedName": "base"},
        "adapters": [{"name": "sql", "source": "file:///adapters/sql"}],
        "resources": {"gpu": {"count": 0}},
        "replicas": 2,
    }
    manifest = write_manifest(tmp_path / "lora.yaml", "lora", spec)
    fleet = start_fleet(manifest, extra=("--watch",))
    wait_until(lambda: fleet.ready("lora") == 2, timeout=60, what="two ready replicas")
    models = httpx.get(f"{fleet.url}/v1/models", timeout=10).json()["data"]
    assert {(m["id"], m.get("parent")) for m in models} == {("base", None), ("sql", "base")}
    answer = _chat(fleet.url, "sql")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "sql"
    before = fleet.pids()
    assert len(before) == 2

    spec["adapters"].append({"name": "legal", "source": "file:///adapters/legal"})
    write_manifest(manifest, "lora", spec)
    wait_until(lambda: "adapters changed" in fleet.output(), timeout=30, what="the edit applied")
    wait_until(
        lambda: "legal" in {m["id"] for m in httpx.get(f"{fleet.url}/v1/models").json()["data"]},
        timeout=30,
        what="the gateway to list the new adapter",
    )
    answer = _chat(fleet.url, "legal")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "legal"
    assert fleet.pids() == before  # the same engine processes: loaded at runtime
    out = fleet.stop()
    assert "replacing replicas" not in out
