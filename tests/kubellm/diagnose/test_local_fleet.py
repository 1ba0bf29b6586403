"""`kubellm diagnose` with no flags: it finds the local fleet, its gateway and engines.

The live tests start `kubellm up --engine sim` as a subprocess (the `start_fleet` fixture,
tests/fixtures/fleets.py) and run `kubellm diagnose --run-dir ...` against it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from kubellm import api
from kubellm.cli import main
from kubellm.diagnose import collect, triage
from kubellm.diagnose.snapshot import Snapshot
from tests.fixtures.engines import free_port, wait_until
from tests.fixtures.fleets import write_manifest
from tests.kubellm.diagnose.test_triage import HEALTHY

IDLE_GATEWAY = Snapshot(window_s=30, request_rate=0.0, engines=2, running=0, waiting=0,
                        kv_cache_usage_max=0.0)  # fmt: skip


def _spec(**fields: Any) -> api.LLMDeploymentSpec:
    return api.LLMDeploymentSpec.model_validate({"model": {"source": "hf://a/b"}, **fields})


# --------------------------------------------------------------------------- pure


def test_no_requests_in_the_window_is_said_as_such() -> None:
    [finding] = triage.triage(IDLE_GATEWAY)
    assert finding.code == "no-traffic"
    assert "No requests in the 30s window" in finding.title
    text = triage.format_findings(IDLE_GATEWAY, [finding])
    assert "no requests in the window" in text
    assert "latency within targets" not in text and "nowhere" not in text
    # Engines only (no gateway): nothing running, no latency, no tokens is no traffic too.
    engines_only = Snapshot(window_s=5, engines=1, running=0, waiting=0, kv_cache_usage_max=0.0,
                            generation_tokens_per_s=0.0)  # fmt: skip
    assert [f.code for f in triage.triage(engines_only)] == ["no-traffic"]
    # A busy engine with no finished request in the window is not idle.
    assert triage.triage(replace(engines_only, running=3)) == []


def test_overflow_advice_fits_a_manifest_without_autoscaling() -> None:
    overflowing = replace(HEALTHY, fallback_share=0.3)
    [generic] = triage.triage(overflowing)
    [fixed] = triage.triage(overflowing, spec=_spec(replicas=2))
    text = " ".join(fixed.suggestions)
    assert "maxReplicas" not in text and "targetKVCacheUsage" not in text
    assert "autoscaling is off: raise spec.replicas (now 2)" in text
    scaled = _spec(autoscaling={"minReplicas": 1, "maxReplicas": 3})
    [auto] = triage.triage(overflowing, spec=scaled)
    assert "raise autoscaling.maxReplicas (now 3)" in " ".join(auto.suggestions)
    assert "maxReplicas" in " ".join(generic.suggestions)


def test_prefill_and_idle_advice_skip_what_the_manifest_already_does() -> None:
    slow_prefill = replace(HEALTHY, ttft_p95_s=6.0, waiting=0, queue_wait_p95_s=0.0,
                           mean_prompt_tokens=4000, prefix_cache_hit_rate=0.05)  # fmt: skip
    [finding] = triage.triage(slow_prefill, spec=_spec())
    text = " ".join(finding.suggestions)
    assert "lower engine.chunkedPrefill.maxNumBatchedTokens (now 2048)" in text
    assert "turn on prefix caching" not in text
    [off] = triage.triage(
        slow_prefill, spec=_spec(engine={"prefixCaching": False}, routing={"policy": "least-load"})
    )
    assert "engine.prefixCaching: true" in " ".join(off.suggestions)
    assert "routing.policy: prefix-aware (now least-load)" in " ".join(off.suggestions)

    idle = replace(HEALTHY, kv_cache_usage_max=0.02, running=0, request_rate=0.05, engines=3)
    [fixed] = triage.triage(idle, spec=_spec(replicas=3))
    text = " ".join(fixed.suggestions)
    assert "spec.replicas, now 3" in text and "minReplicas" not in text
    zero = _spec(autoscaling={"minReplicas": 0, "maxReplicas": 3, "scaleToZero": True})
    [auto] = triage.triage(idle, spec=zero)
    assert not any("enable autoscaling.scaleToZero" in s for s in auto.suggestions)


def test_local_fleet_is_read_from_the_run_directory(tmp_path: Path) -> None:
    assert collect.local_fleet(tmp_path) is None
    (tmp_path / "fleet.json").write_text(json.dumps({
        "gateway": "http://127.0.0.1:8080",
        "deployments": {"tiny": {"model": "tiny", "spec": {"model": {"source": "hf://a/b"}},
                                 "replicas": [
                                     {"url": "http://127.0.0.1:4001", "state": "ready"},
                                     {"url": "http://127.0.0.1:4002", "state": "starting"},
                                 ]}},
    }))  # fmt: skip
    fleet = collect.local_fleet(tmp_path)
    assert fleet is not None
    assert fleet.gateway == "http://127.0.0.1:8080"
    assert fleet.engines == ["http://127.0.0.1:4001"]
    assert fleet.specs == {"tiny": {"model": {"source": "hf://a/b"}}}
    (tmp_path / "fleet.json").write_text("{not json")
    assert collect.local_fleet(tmp_path) is None


def test_without_a_fleet_or_flags_it_says_how_to_get_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diagnose", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no running fleet found" in err and "kubellm up" in err and "--url" in err


def test_a_refused_connection_names_the_url(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["diagnose", "--url", url, "--window", "0.05", "--run-dir", "/nonexistent"]) == 1
    err = capsys.readouterr().err
    assert f"cannot connect to {url}/metrics" in err
    assert "Traceback" not in err


# --------------------------------------------------------------------------- live


def _simwrite_manifest(tmp_path: Path) -> Path:
    return write_manifest(tmp_path / "diag.yaml", "diag", {
        "model": {"source": "file:///nonexistent/sim-only", "servedName": "diag"},
        "resources": {"gpu": {"count": 0}},
        "replicas": 1,
    })  # fmt: skip


def test_diagnose_finds_the_local_fleet_idle_then_loaded(
    start_fleet: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = start_fleet(_simwrite_manifest(tmp_path))
    wait_until(lambda: fleet.ready("diag") == 1, timeout=60, what="one ready replica")
    run_dir = str(fleet.run_dir)

    # Idle: no flags but where the fleet runs; the window sees no request.
    assert main(["diagnose", "--run-dir", run_dir, "--window", "0.5", "--samples", "2"]) == 0
    captured = capsys.readouterr()
    assert "no-traffic" in captured.out and "No requests in the 0.5" in captured.out
    assert "1 engine(s)" in captured.out
    assert f"gateway {fleet.url}" in captured.err  # the progress line says what it watches

    # Loaded: requests through the gateway during the window.
    stop = threading.Event()
    sent: list[int] = []

    def load() -> None:
        with httpx.Client(timeout=30) as client:
            for _ in range(200):  # bounded in count; the event ends it sooner
                if stop.is_set():
                    return
                response = client.post(
                    f"{fleet.url}/v1/completions",
                    json={"model": "diag", "prompt": "hello there", "max_tokens": 8},
                )
                sent.append(response.status_code)

    worker = threading.Thread(target=load)
    worker.start()
    try:
        wait_until(lambda: len(sent) >= 2, timeout=30, what="traffic through the gateway")
        code = main(["diagnose", "--run-dir", run_dir, "--window", "1", "--samples", "2",
                     "--json"])  # fmt: skip
    finally:
        stop.set()
        worker.join(timeout=60)
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    snap = report["snapshot"]
    assert snap["engines"] == 1  # found without --engine-url
    assert snap["latency_source"].startswith("gateway")  # found without --url
    assert snap["request_rate"] > 0 and snap["prefix_cache_hit_rate"] is not None
    assert "no-traffic" not in [f["code"] for f in report["findings"]]
    assert set(sent) == {200}

    # --url of the local fleet's gateway also finds its engines.
    assert main(["diagnose", "--url", fleet.url, "--run-dir", run_dir, "--window", "0.2",
                 "--samples", "1", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["snapshot"]["engines"] == 1
    fleet.stop()
