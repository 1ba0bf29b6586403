"""kubellm bench against the simulated engine on loopback (and a mocked stream)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kubellm.bench import runner, workloads
from kubellm.cli import main
from tests.fixtures.engines import free_port
from tests.fixtures.servers import ServerThread


def test_rate_run_prints_the_table_and_writes_json_and_png(
    sim_server: Callable[..., str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = sim_server(served_model_name="sim")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(
        [
            "bench",
            "--url",
            url,
            "--model",
            "sim",
            "--sweep",
            "50,100",
            "--num-requests",
            "12",
            "--input-len",
            "8:16",
            "--output-len",
            "5",
            "--ttft-target",
            "5",
            "--itl-target",
            "1",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "LOAD" in captured.out and "50/s" in captured.out and "100/s" in captured.out
    assert "12/12" in captured.err  # the progress indicator reached the end
    runs = json.loads(out_json.read_text())["runs"]
    assert [r["rate"] for r in runs] == [50, 100]
    for r in runs:
        assert (r["completed"], r["failed"]) == (12, 0)
        assert r["total_output_tokens"] == 12 * 5  # from the usage chunk
        assert r["ttft_s"]["p50"] is not None and r["e2e_s"]["p99"] >= r["ttft_s"]["p50"]
        assert r["goodput"]["share"] == 1.0
    assert out_png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("http_client", ["aiohttp", "httpx"])
def test_rejected_requests_are_counted_as_failures_with_the_servers_message(
    http_client: str,
    sim_server: Callable[..., str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if http_client == "aiohttp":
        pytest.importorskip("aiohttp")
    url = sim_server(served_model_name="sim")
    out_json = tmp_path / "r.json"
    args = ["--concurrency", "2", "--num-requests", "3", "--output-len", "1000000"]
    args += ["--quiet", "--http-client", http_client, "--json", str(out_json)]
    code = main(["bench", "--url", url, "--model", "sim", *args])
    assert code == 1  # nothing completed
    assert "HTTP 400: This model's maximum context length" in capsys.readouterr().out
    run = json.loads(out_json.read_text())["runs"][0]
    assert (run["completed"], run["failed"]) == (0, 3)
    assert sum(run["errors"].values()) == 3


def test_multi_turn_sessions_carry_their_growing_history(sim_server: Callable[..., str]) -> None:
    url = sim_server(served_model_name="sim")
    convs = workloads.build(
        workloads.WorkloadSpec(
            kind="multi-turn", num_requests=6, turns=3, input_len=(10, 10), output_len=(4, 4)
        )
    )
    target = runner.Target(url=url, model="sim")
    schedule = runner.Schedule(concurrency=2)
    results, _ = asyncio.run(runner.run_once(convs, target, schedule, http_client="httpx"))
    assert len(results) == 6 and all(r.ok for r in results)
    # each session's prompt (as counted by the server) grows turn after turn
    by_start = sorted(results, key=lambda r: r.start)
    prompts = sorted(r.prompt_tokens or 0 for r in by_start)
    assert prompts[-1] > prompts[0] + 10


def test_duration_bounds_a_run(sim_server: Callable[..., str]) -> None:
    url = sim_server(served_model_name="sim", time_scale=1.0)
    convs = workloads.build(workloads.WorkloadSpec(num_requests=500, output_len=(4, 4)))
    schedule = runner.Schedule(rate=20.0, duration_s=0.5)
    results, _ = asyncio.run(runner.run_once(convs, runner.Target(url, "sim"), schedule))
    assert 0 < len(results) < 500
    assert all(r.start < 0.5 for r in results)


def _sse(events: list[str]) -> bytes:
    return "".join(f"data: {e}\n\n" for e in [*events, "[DONE]"]).encode()


def test_output_tokens_come_from_chunks_when_usage_is_not_sent() -> None:
    chunks = [json.dumps({"choices": [{"text": t}]}) for t in ("a", "", "b", "c")]

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 7
        return httpx.Response(200, content=_sse(chunks))

    async def go() -> runner.RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            target = runner.Target("http://x/v1", "m", ignore_eos=True)
            result, text = await runner.send(client, target, workloads.Turn("p", 7, 1), None)
            assert text == "abc"
            return result

    result = asyncio.run(go())
    assert result.ok and result.output_tokens == 3 and len(result.itls) == 2
    assert result.ttft is not None and result.e2e is not None and result.e2e >= result.ttft


def test_an_error_in_the_stream_fails_the_request() -> None:
    def handler(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse([json.dumps({"error": {"message": "oom"}})]))

    async def go() -> runner.RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            result, _ = await runner.send(
                client, runner.Target("http://x", "m"), workloads.Turn("p", 1, 1), []
            )
            return result

    result = asyncio.run(go())
    assert not result.ok and result.error == "stream error: oom"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "0"], "--rate"),
        ([], "give --rate"),
        (["--concurrency", "0"], "--concurrency"),
        (["--rate", "1", "--sweep", "1,2"], "one of --rate and --sweep"),
        (["--rate", "1", "--workload", "trace"], "--trace"),
        (["--rate", "1", "--num-requests", "0"], "--num-requests"),
    ],
)
def test_bad_options_are_named(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "--url", "http://127.0.0.1:9", "--model", "m", *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_an_infinite_rate_is_written_as_valid_json(
    sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server(served_model_name="sim")
    out = tmp_path / "inf.json"
    args = ["--rate", "inf", "--num-requests", "4", "--output-len", "3", "--quiet"]
    assert main(["bench", "--url", url, "--model", "sim", *args, "--json", str(out)]) == 0

    def no_constants(name: str) -> None:
        raise AssertionError(f"not JSON: {name}")

    document = json.loads(out.read_text(), parse_constant=no_constants)
    assert document["runs"][0]["rate"] == "inf" and document["runs"][0]["completed"] == 4


def _too_busy_app() -> Any:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def busy(_: Any) -> JSONResponse:
        body = {"error": {"message": "overloaded, retry after 7 s"}}
        return JSONResponse(body, status_code=429, headers={"Retry-After": "7"})

    return Starlette(routes=[Route("/v1/completions", busy, methods=["POST"])])


@pytest.mark.parametrize("http_client", ["aiohttp", "httpx"])
def test_error_summaries_keep_the_address_and_the_retry_after(
    http_client: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused = f"127.0.0.1:{free_port()}"
    busy = ServerThread(_too_busy_app())
    busy_url = busy.start().url
    try:
        runs = {}
        for name, url in (("refused", f"http://{refused}"), ("busy", busy_url)):
            out_json = tmp_path / f"{name}.json"
            args = ["--concurrency", "1", "--num-requests", "2", "--quiet"]
            args += ["--http-client", http_client, "--json", str(out_json)]
            assert main(["bench", "--url", url, "--model", "m", *args]) == 1
            runs[name] = json.loads(out_json.read_text())["runs"][0]["errors"]
    finally:
        busy.stop()
    capsys.readouterr()
    [refused_kind] = runs["refused"]
    assert refused in refused_kind and "N.N.N.N" not in refused_kind
    assert runs["busy"] == {"HTTP 429: overloaded, retry after 7 s (Retry-After: 7)": 2}
