"""`kubellm up` end to end: real processes, a real gateway port, real signals.

Each test starts `kubellm up` as a subprocess on loopback ports, talks to it
over HTTP, and stops it with SIGTERM, then checks that no process of the fleet
is left and the port is free.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.engines import TINY_EXTRA_ARGS, VLLM_START_TIMEOUT_S, wait_until
from tests.fixtures.fleets import write_manifest

ROOT = Path(__file__).resolve().parents[3]


def _process_group(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid` (a replica and its children)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (exited, not yet reaped by its parent) is gone too.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z"


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _chat(url: str, model: str, max_tokens: int, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hello"}],
              "max_tokens": max_tokens},
        timeout=timeout,
    )  # fmt: skip


def test_bad_manifest_fails_before_anything_starts(start_fleet: Any) -> None:
    fleet = start_fleet(ROOT / "examples" / "invalid" / "min-over-max.yaml")
    fleet.process.wait(timeout=60)
    out = fleet.output()
    assert fleet.process.returncode == 1
    assert "spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas" in out
    assert fleet.state() is None  # nothing was started
    assert _port_free(fleet.port)


def test_sim_fleet_scales_up_under_load_and_back_after_its_window(
    start_fleet: Any, tmp_path: Path
) -> None:
    manifest = write_manifest(
        tmp_path / "scaling.yaml",
        "scaling",
        {
            "model": {"source": "file:///nonexistent/sim-only", "servedName": "scaling"},
            "resources": {"gpu": {"count": 0}},
            "replicas": 1,
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 2,
                "targetQueueDepth": 2,
                "scaleDownStabilizationSeconds": 4,
            },
        },
    )
    # The tiny-cpu simulator profile runs 16 sequences at once; 2 wall seconds per
    # simulated second keeps a queue long enough for 1-second autoscaler periods.
    fleet = start_fleet(manifest, extra=("--autoscale-period", "1", "--sim-time-scale", "2"))
    wait_until(lambda: fleet.ready("scaling") == 1, timeout=60, what="one ready replica")
    assert _chat(fleet.url, "scaling", 4).status_code == 200

    # 32 concurrent requests of 400 tokens: 16 run, 16 wait (queue 16 > target 2 x 1).
    deadline = time.monotonic() + 90
    with ThreadPoolExecutor(max_workers=32) as pool:
        while fleet.desired("scaling") != 2 and time.monotonic() < deadline:
            batch = [pool.submit(_chat, fleet.url, "scaling", 400) for _ in range(32)]
            wait_until(
                lambda batch=batch: fleet.desired("scaling") == 2 or all(f.done() for f in batch),
                timeout=120,
                what="scale-up or the batch to finish",
            )
        assert fleet.desired("scaling") == 2, "the autoscaler did not scale up under load"
        wait_until(lambda: fleet.ready("scaling") == 2, timeout=60, what="two ready replicas")
    # Load is gone: after the 4-second window the autoscaler returns to one replica.
    wait_until(lambda: fleet.desired("scaling") == 1, timeout=60, what="scale back down")
    wait_until(lambda: len(fleet.pids()) == 1, timeout=60, what="the drained replica stopped")
    pids = fleet.pids()
    out = fleet.stop()
    assert fleet.process.returncode == 0, out
    # The autoscaler said why, with the figures (the queue it saw depends on timing).
    assert re.search(r": 1 -> 2 replicas; queue [1-9]\d* waiting on 1 ready", out), out
    assert "2 -> 1 replicas; queue 0 waiting on 2 ready" in out
    assert all(_gone(pid) and _process_group(pid) == [] for pid in pids), out
    assert _port_free(fleet.port)


def test_a_crashing_replica_is_restarted_and_reported(start_fleet: Any, tmp_path: Path) -> None:
    manifest = write_manifest(
        tmp_path / "crash.yaml",
        "crash",
        {"model": {"source": "file:///nonexistent/sim-only"}, "resources": {"gpu": {"count": 0}}},
    )
    fleet = start_fleet(manifest)
    wait_until(lambda: fleet.ready("crash") == 1, timeout=60, what="one ready replica")
    (first,) = fleet.pids()
    os.kill(first, signal.SIGKILL)
    wait_until(
        lambda: fleet.ready("crash") == 1 and fleet.pids() not in ({first}, set()),
        timeout=60,
        what="the replica restarted",
    )
    assert _chat(fleet.url, "crash", 4).status_code == 200
    out = fleet.stop()
    assert "exited with status -9; restart 1" in out


def test_watch_applies_a_manifest_edit(start_fleet: Any, tmp_path: Path) -> None:
    spec = {"model": {"source": "file:///nonexistent/sim-only"}, "resources": {"gpu": {"count": 0}}}
    manifest = write_manifest(tmp_path / "watched.yaml", "watched", spec)
    fleet = start_fleet(manifest, extra=("--watch",))
    wait_until(lambda: fleet.ready("watched") == 1, timeout=60, what="one ready replica")
    write_manifest(manifest, "watched", {**spec, "replicas": 2})
    wait_until(lambda: fleet.ready("watched") == 2, timeout=60, what="the edit applied")
    # A bad edit is refused with the CRD's message; the fleet keeps running as it was.
    write_manifest(manifest, "watched", {**spec, "replicas": -1})
    wait_until(lambda: "not applied" in fleet.output(), timeout=30, what="the bad edit refused")
    assert "spec.replicas" in fleet.output()
    assert fleet.ready("watched") == 2
    out = fleet.stop()
    assert "watched scaled to 2" in out


@pytest.mark.vllm
def test_real_vllm_replica_answers_through_the_gateway(
    start_fleet: Any, tmp_path: Path, tiny_model_dir: Path
) -> None:
    manifest = write_manifest(
        tmp_path / "tiny.yaml",
        "tiny",
        {
            "model": {"source": f"file://{tiny_model_dir}", "servedName": "tiny"},
            "engine": {
                "dtype": "float32",
                "maxModelLen": 1024,
                "blockSize": 32,
                "extraArgs": list(TINY_EXTRA_ARGS),
            },
            "resources": {"gpu": {"count": 0}},
        },
    )
    fleet = start_fleet(manifest, engine="vllm")
    wait_until(lambda: fleet.ready("tiny") == 1, VLLM_START_TIMEOUT_S, what="vLLM ready")
    with httpx.stream(
        "POST",
        f"{fleet.url}/v1/chat/completions",
        json={"model": "tiny", "stream": True, "max_tokens": 8,
              "messages": [{"role": "user", "content": "What is kubellm?"}]},
        timeout=60,
    ) as response:  # fmt: skip
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks)
    assert all(c["model"] == "tiny" for c in chunks)
    pids = fleet.pids()
    out = fleet.stop()
    assert fleet.process.returncode == 0, out
    # vLLM's own children (its engine core) share the replica's process group.
    assert all(_process_group(p) == [] for p in pids), out
    assert _port_free(fleet.port)


def test_a_port_clash_names_the_port_and_suggests_another(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "clash.yaml", "clash", {
        "model": {"source": "file:///nonexistent/sim-only"}, "resources": {"gpu": {"count": 0}},
    })  # fmt: skip
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kubellm.cli", "up", "--engine", "sim", "--port", str(port),
             "--run-dir", str(tmp_path / "run"), "-f", str(manifest)],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "--port" in result.stderr
    assert "Errno" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "fleet.json").exists()  # nothing was started


def test_a_replica_spanning_nodes_is_refused_with_vllm_and_says_what_to_do(tmp_path: Path):
    manifest = write_manifest(tmp_path / "big.yaml", "big", {
        "model": {"source": "file:///nonexistent/big"},
        "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2},
        "resources": {"nodes": 2, "gpu": {"count": 8}},
    })  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "kubellm.cli", "up", "--engine", "vllm", "--port", "1",
         "--run-dir", str(tmp_path / "run"), "-f", str(manifest)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert "big: spec.resources.nodes is 2" in result.stderr
    assert "--engine sim" in result.stderr and "LeaderWorkerSet" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "fleet.json").exists()  # nothing was started


def test_up_help_explains_every_option_with_its_default() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kubellm.cli", "up", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--autoscale-period SECONDS how often the autoscaler" in text
    assert "(default: 5.0)" in text and "(default: 8080)" in text
    # --sim-profile lists every profile the simulator knows, and its default
    from kubellm.engine.sim_profiles import PROFILES

    assert "known: " + ", ".join(sorted(PROFILES)) + " (default: tiny-cpu for deployments" in text
    assert {"llama-3.1-405b-2x8xh100", "llama-3.1-8b-h100", "tiny-cpu"} <= set(PROFILES)


def test_the_starting_line_gives_elapsed_time_and_the_log(start_fleet: Any, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "slow.yaml", "slow", {
        "model": {"source": "file:///nonexistent/sim-only"}, "resources": {"gpu": {"count": 0}},
    })  # fmt: skip
    fleet = start_fleet(manifest)
    wait_until(lambda: fleet.ready("slow") == 1, timeout=60, what="one ready replica")
    out = fleet.stop()
    log = fleet.run_dir / "logs" / "slow-0.log"
    assert "slow-0 starting on port" in out and f"its output goes to {log}" in out
