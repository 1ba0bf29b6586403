"""kubellm diagnose against a live simulated engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kubellm.cli import main
from kubellm.diagnose import collect, triage


def test_an_idle_engine_after_a_little_traffic_is_reported_as_low_utilization(
    sim_server: Callable[..., str],
) -> None:
    url = sim_server(served_model_name="sim")

    def traffic(_: float) -> None:  # the window: a few short requests, then quiet
        for _ in range(4):
            response = httpx.post(
                f"{url}/v1/completions",
                timeout=30,
                json={"model": "sim", "prompt": "hello world", "max_tokens": 4},
            )
            assert response.status_code == 200

    snap = collect.scrape(None, [url], 1.0, wait=traffic)
    assert snap.engines == 1 and snap.latency_source.startswith("engines")
    assert snap.ttft_p50_s is not None and snap.mean_prompt_tokens is not None
    assert snap.running == 0 and snap.kv_cache_usage_max is not None
    assert [f.code for f in triage.triage(snap)] == ["low-utilization"]


def test_diagnose_command_prints_json(
    sim_server: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = sim_server(served_model_name="sim")
    assert main(["diagnose", "--engine-url", url, "--window", "0.05", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["snapshot"]["engines"] == 1 and isinstance(report["findings"], list)


def test_diagnose_needs_a_source(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["diagnose", "--run-dir", str(tmp_path)]) == 2  # no fleet runs there
    assert "--url" in capsys.readouterr().err
    assert main(["diagnose", "--url", "http://127.0.0.1:9", "--window", "0"]) == 2
