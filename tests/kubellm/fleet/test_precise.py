"""`kubellm up` with spec.routing.prefixIndex precise on simulated engines: each local
replica publishes KV events on its own ports (they share one host), the gateway's endpoint
carries them, and the gateway scores every replica from its events (no approximate
fallback once they are followed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.engines import wait_until
from tests.fixtures.fleets import write_manifest

FALLBACKS = "kubellm_gateway_prefix_index_fallbacks_total"
ENTRIES = "kubellm_gateway_kv_index_entries"


def _gateway(url: str) -> tuple[float, float]:
    """(candidates scored approximately so far, block entries in the precise index)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    fallbacks = entries = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == FALLBACKS:
                fallbacks += sample.value
            elif sample.name == ENTRIES:
                entries = sample.value
    return fallbacks, entries


def test_each_replica_publishes_on_its_own_port_and_the_gateway_follows_them(
    start_fleet: Any, tmp_path: Path
) -> None:
    spec = {
        "model": {"source": "hf://org/precise", "servedName": "precise"},
        "engine": {"maxModelLen": 2048},
        "resources": {"gpu": {"count": 0}},
        "replicas": 2,
        "routing": {"policy": "prefix-aware", "prefixIndex": "precise"},
    }
    fleet = start_fleet(write_manifest(tmp_path / "precise.yaml", "precise", spec),
                        extra=("--sim-time-scale", "0.05"))  # fmt: skip
    wait_until(lambda: fleet.ready("precise") == 2 or fleet.process.poll() is not None, 60,
               "two simulated replicas to be ready")  # fmt: skip
    assert fleet.ready("precise") == 2, fleet.output()
    replicas = (fleet.state() or {})["deployments"]["precise"]["replicas"]
    ports = {r["kvEventsPort"] for r in replicas}
    assert len(ports) == 2  # one pair each
    for index, replica in enumerate(replicas):
        log = (fleet.run_dir / "logs" / f"precise-{index}.log").read_text()
        assert f"KV events on {replica['kvEventsPort']}" in log

    def ask(i: int) -> None:
        # a shared system prompt, then the request's own text: prefix-aware scores it
        body = {"model": "precise", "prompt": "shared words " * 60 + f"question {i}",
                "max_tokens": 4}  # fmt: skip
        response = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text

    def scored_from_events(i: int) -> bool:
        before = _gateway(fleet.url)[0]
        ask(i)
        return _gateway(fleet.url)[0] == before

    for i in range(6):  # the model's traffic shares prefixes: prefix-aware scoring is on
        ask(i)
    # the gateway follows both replicas' events once its replay probes are answered
    attempts = iter(range(1000))
    wait_until(lambda: scored_from_events(next(attempts)), 30,
               "a request scored from both replicas' events", interval=0.2)  # fmt: skip
    fallbacks = _gateway(fleet.url)[0]
    for i in range(2000, 2006):
        ask(i)
    assert _gateway(fleet.url)[0] == fallbacks  # every candidate scored from its events
    wait_until(lambda: _gateway(fleet.url)[1] > 0, 10, "the index's entries gauge")
    fleet.stop()
