"""`kubellm plan --calibrate URL`: a running replica measured over HTTP, and the plan made
with a simulated replica fitted to it. The replica is the simulated engine server on
loopback, in real time, running the plan's own profile with every step 4x slower: the
calibration must find that replica (its capacity and the factor), not the datasheet's."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from kubellm import api, cli
from kubellm.simulation import calibrate, experiment, plan

SLOWDOWN = 4.0
SIZES = ["--calibrate-prompt-tokens", "512", "--calibrate-output-tokens", "32"]
# bounded: 4 req/s (met), 8 (missed), 6: three points of 8 s each
SEARCH = ["--calibrate-start", "4", "--calibrate-seconds", "8", "--calibrate-max-points", "3",
          "--calibrate-bisections", "1", "--calibrate-timeout", "30"]  # fmt: skip


def write_trace(path: Path) -> None:
    """60 s at 4 req/s of 512-token prompts and 32 output tokens: about one slow replica."""
    rows = [(i / 4, 512, 32) for i in range(240)]
    path.write_text(
        "timestamp,prompt_tokens,output_tokens\n" + "".join(f"{t},{p},{o}\n" for t, p, o in rows)
    )


def test_a_slower_replica_is_measured_and_the_plan_simulates_it(
    sim_server: Callable[..., str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = sim_server(served_model_name="m", profile=experiment.profile(SLOWDOWN), time_scale=1.0)
    trace = tmp_path / "t.csv"
    write_trace(trace)
    code = cli.main(
        ["plan", "--trace", str(trace), "--calibrate", url, *SIZES, *SEARCH, "--load-seconds",
         "20", "--json"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    document = json.loads(out)
    measured = document["calibration"]
    assert measured["model"] == "m"
    assert [p["rate"] for p in measured["points"]] == [4, 8, 6]
    assert measured["points"][0]["attainment"] >= 0.99
    assert measured["points"][1]["attainment"] < 0.99  # the datasheet replica serves 48 req/s
    assert measured["capacity_rps"] in (4, 6)
    # the simulated replica fitted to it runs near the server's own step costs
    assert 2.5 <= measured["slowdown"] <= 6.5, measured
    assert document["replica"]["slowdown"] == measured["slowdown"]
    assert "step costs" in document["replica"]["profile"]
    # the plan's capacity is the fitted replica's on the trace's requests: near the measured
    assert 3.0 <= document["replica"]["capacity_rps"] <= 8.0, document["replica"]
    assert "calibrate: 8 req/s" in err  # every point is logged as it is measured


def test_the_fit_finds_the_factor_of_a_simulated_replica() -> None:
    slo, sizes = api.SLO(), [(512, 32)]

    def meets(rate: float, factor: float) -> bool:
        return plan.meets(sizes, slo, rate, factor)

    served = calibrate.simulated_capacity(meets, SLOWDOWN, 6.0)  # the x4 replica: ~6.4 req/s
    factor = calibrate.fit_slowdown(served, meets)
    assert factor == pytest.approx(SLOWDOWN, rel=0.2)  # 99% of ~800 requests: a noisy edge
    assert calibrate.simulated_capacity(meets, factor, served) == pytest.approx(served, rel=0.1)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_an_unreachable_replica_is_refused_naming_the_url(capsys) -> None:
    url = _closed_port()
    code = cli.main(["plan", "--calibrate", url, *SIZES, *SEARCH])
    _, err = capsys.readouterr()
    assert code == 2 and url in err and "cannot list its models" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--calibrate", "127.0.0.1:8000"], "expected an http:// or https:// URL"),
        (["--calibrate", "http://127.0.0.1:1", "--capacity", "3"], "leave --capacity out"),
        (["--calibrate", "http://127.0.0.1:1", "--calibrate-seconds", "0"], "must be positive"),
        (["--calibrate", "http://127.0.0.1:1"], "needs --calibrate-prompt-tokens"),
    ],
)
def test_bad_calibration_flags_are_refused(argv: list[str], message: str, capsys) -> None:
    code = cli.main(["plan", *argv])
    _, err = capsys.readouterr()
    assert code == 2 and message in err


def test_every_request_failing_is_an_error_not_a_capacity(sim_server) -> None:
    url = sim_server(served_model_name="m", profile=experiment.profile(), time_scale=1.0)
    with pytest.raises(calibrate.CalibrationError, match="every request failed"):
        asyncio.run(
            calibrate.search(url, [(16, 4)], api.SLO(), model="no-such-model", seconds=1.0,
                             max_points=2, request_timeout=10)
        )  # fmt: skip


@pytest.mark.vllm
def test_the_tiny_vllm_engine_is_measured(vllm_server: str, capsys) -> None:
    # the real engine on CPU: short requests, an SLO a loaded 2-core machine meets at low rates
    code = cli.main(
        ["plan", "--calibrate", vllm_server, "--calibrate-prompt-tokens", "32",
         "--calibrate-output-tokens", "8", "--calibrate-start", "1", "--calibrate-seconds", "3",
         "--calibrate-max-points", "3", "--calibrate-bisections", "1", "--calibrate-timeout",
         "30", "--ttft", "2", "--itl", "0.5", "--json"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    measured = json.loads(out)["calibration"]
    first = measured["points"][0]
    assert first["rate"] == 1 and first["attainment"] >= 0.99 and first["errors"] == 0
    assert first["prompt_tokens"] and first["output_tokens"] == 8  # ignore_eos: all 8 decoded
    assert measured["capacity_rps"] >= 1 and 1 <= len(measured["points"]) <= 3
    assert measured["slowdown"] > 0 and measured["simulated_rps"] > 0
