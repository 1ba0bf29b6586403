"""`kubellm up` serves a manifest's LoRA adapters, and a manifest edit that adds one loads it
on the running replicas: the same processes answer (no restart). The autoscaler's
status.adapters (loaded on N of M ready replicas) shows in the state `kubellm status` reads
and in its table."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path
from typing import Any

import httpx

from kubellm.fleet import show
from tests.fixtures.engines import wait_until
from tests.fixtures.fleets import write_manifest


def _chat(url: str, model: str) -> httpx.Response:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def _adapters(fleet: Any) -> dict[str, tuple[int, int]]:
    """status.adapters as the fleet's state file has it: name -> (loaded, ready replicas)."""
    deployment = (fleet.state() or {}).get("deployments", {}).get("lora", {})
    return {a["name"]: (a["loadedReplicas"], a["replicas"])
            for a in deployment.get("adapters") or []}  # fmt: skip


def _printed_status(fleet: Any) -> str:
    """What `kubellm status` prints for the fleet (its adapters table included)."""
    parser = argparse.ArgumentParser()
    show.configure(parser)
    args = parser.parse_args(["--run-dir", str(fleet.run_dir)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert show.run(args) == 0
    return out.getvalue()


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
    fleet = start_fleet(manifest, extra=("--watch", "--autoscale-period", "0.5"))
    wait_until(lambda: fleet.ready("lora") == 2, timeout=60, what="two ready replicas")
    models = httpx.get(f"{fleet.url}/v1/models", timeout=10).json()["data"]
    assert {(m["id"], m.get("parent")) for m in models} == {("base", None), ("sql", "base")}
    answer = _chat(fleet.url, "sql")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "sql"
    before = fleet.pids()
    assert len(before) == 2
    wait_until(lambda: _adapters(fleet) == {"sql": (2, 2)}, timeout=30, what="status.adapters")

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
    # loaded on the one replica the gateway picked for it (the other still lacks it)
    wait_until(lambda: _adapters(fleet) == {"sql": (2, 2), "legal": (1, 2)}, timeout=30,
               what="status.adapters to show legal")  # fmt: skip
    printed = _printed_status(fleet)
    assert "legal" in printed and "1/2" in printed
    out = fleet.stop()
    assert "replacing replicas" not in out
