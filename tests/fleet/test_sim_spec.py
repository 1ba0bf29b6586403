"""`kubellm up --engine sim` simulates the manifest's engine fields, not only a profile."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics
from tests.fixtures.engines import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
MAX_NUM_SEQS = 8
REQUESTS = 20


def _engine_gauges(url: str) -> tuple[float, float]:
    """(running, waiting) from a replica's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values[metrics.NUM_REQUESTS_RUNNING], values[metrics.NUM_REQUESTS_WAITING]


def test_a_sim_fleet_runs_at_most_max_num_seqs_per_replica_and_queues_the_rest(
    tmp_path: Path,
) -> None:
    manifest = tmp_path / "seqs.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kubellm.io/v1alpha1",
                "kind": "LLMDeployment",
                "metadata": {"name": "seqs"},
                "spec": {
                    "model": {"source": "hf://org/seqs", "servedName": "seqs"},
                    "engine": {"maxNumSeqs": MAX_NUM_SEQS, "maxModelLen": 1024},
                    "resources": {"gpu": {"count": 0}},
                    "replicas": 1,
                },
            }
        )
    )
    run_dir = tmp_path / "run"
    log = tmp_path / "fleet.log"
    argv = [sys.executable, "-m", "kubellm.cli", "up", "--engine", "sim", "-f", str(manifest),
            "--port", str(free_port()), "--run-dir", str(run_dir), "--status-interval", "0",
            "--sim-time-scale", "4"]  # fmt: skip
    with log.open("w") as out:
        fleet = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    pool = ThreadPoolExecutor(REQUESTS)
    try:

        def replica_url() -> str | None:
            try:
                state = json.loads((run_dir / "fleet.json").read_text())
            except (OSError, ValueError):
                return None
            ready = [r for r in state["deployments"]["seqs"]["replicas"] if r["state"] == "ready"]
            return ready[0]["url"] if ready else None

        wait_until(lambda: replica_url() is not None or fleet.poll() is not None, 60,
                   "the simulated replica to be ready")  # fmt: skip
        url = replica_url()
        assert url, log.read_text()
        # Long answers (seconds at this time scale), sent straight to the replica.
        body = {"model": "seqs", "prompt": "hello " * 20, "max_tokens": 900}
        for _ in range(REQUESTS):
            pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
        seen: list[tuple[float, float]] = []

        def all_arrived() -> bool:
            seen.append(_engine_gauges(url))
            return sum(seen[-1]) == REQUESTS

        wait_until(all_arrived, 30, f"{REQUESTS} requests at the replica")
        for _ in range(20):  # a bounded look over the next moments: never more than 8
            seen.append(_engine_gauges(url))
        assert max(running for running, _ in seen) == MAX_NUM_SEQS
        running, waiting = seen[-1]
        assert (running, waiting) == (MAX_NUM_SEQS, REQUESTS - MAX_NUM_SEQS)
        assert "max_num_seqs 8" in (run_dir / "logs" / "seqs-0.log").read_text()
    finally:
        fleet.send_signal(signal.SIGTERM)
        try:
            fleet.wait(timeout=60)
        finally:
            if fleet.poll() is None:
                fleet.kill()
            pool.shutdown(wait=True, cancel_futures=True)
