"""`kubellm up --engine sim` simulates the manifest's engine fields, not only a profile."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics
from tests.fixtures.engines import wait_until
from tests.fixtures.fleets import write_manifest

MAX_NUM_SEQS = 8
REQUESTS = 20


def _engine_gauges(url: str) -> tuple[float, float]:
    """(running, waiting) from a replica's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values[metrics.NUM_REQUESTS_RUNNING], values[metrics.NUM_REQUESTS_WAITING]


def test_a_sim_fleet_runs_at_most_max_num_seqs_per_replica_and_queues_the_rest(
    start_fleet: Any, tmp_path: Path
) -> None:
    spec = {
        "model": {"source": "hf://org/seqs", "servedName": "seqs"},
        "engine": {"maxNumSeqs": MAX_NUM_SEQS, "maxModelLen": 1024},
        "resources": {"gpu": {"count": 0}},
        "replicas": 1,
    }
    fleet = start_fleet(write_manifest(tmp_path / "seqs.yaml", "seqs", spec),
                        extra=("--sim-time-scale", "4"))  # fmt: skip

    def replica_url() -> str | None:
        state = fleet.state()
        replicas = state["deployments"]["seqs"]["replicas"] if state else []
        ready = [r["url"] for r in replicas if r["state"] == "ready"]
        return ready[0] if ready else None

    wait_until(lambda: replica_url() is not None or fleet.process.poll() is not None, 60,
               "the simulated replica to be ready")  # fmt: skip
    url = replica_url()
    assert url, fleet.output()
    # Long answers (seconds at this time scale), sent straight to the replica.
    body = {"model": "seqs", "prompt": "hello " * 20, "max_tokens": 900}
    with ThreadPoolExecutor(REQUESTS) as pool:
        for _ in range(REQUESTS):
            pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
        try:
            seen: list[tuple[float, float]] = []

            def all_arrived() -> bool:
                seen.append(_engine_gauges(url))
                return sum(seen[-1]) == REQUESTS

            wait_until(all_arrived, 30, f"{REQUESTS} requests at the replica")
            for _ in range(20):  # a bounded look over the next moments: never more than 8
                seen.append(_engine_gauges(url))
            assert max(running for running, _ in seen) == MAX_NUM_SEQS
            assert seen[-1] == (MAX_NUM_SEQS, REQUESTS - MAX_NUM_SEQS)
            log = fleet.run_dir / "logs" / "seqs-0.log"
            assert f"max_num_seqs {MAX_NUM_SEQS}" in log.read_text()
        finally:
            fleet.stop()  # the replica goes: the requests still out end with an error
