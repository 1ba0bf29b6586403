"""`kubellm plan --trace`: the benchmark's figures for the same inputs, its inputs' errors,
the oracle and peak fleets, the break-even, and the plot (tiny traces, seconds of CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.autoscaler import autoscale_sim
from kubellm import cli
from kubellm.simulation import experiment, plan, traces

POLICIES = "kv-queue,kv-queue+fallback+cost"


def write_burst(path: Path, jsonl: bool = False) -> None:
    """3 req/s for 30 s, 16 req/s for 40 s (a burst past two replicas), 3 req/s for 30 s."""
    times: list[float] = []
    for start, end, rate in ((0, 30, 3), (30, 70, 16), (70, 100, 3)):
        times += [start + i / rate for i in range(int((end - start) * rate))]
    rows = [(t, 1800 + (i * 37) % 900, 120 + (i * 11) % 90) for i, t in enumerate(times)]
    if jsonl:
        path.write_text(
            "".join(
                json.dumps({"timestamp": t, "prompt_tokens": p, "output_tokens": o}) + "\n"
                for t, p, o in rows
            )
        )
    else:
        path.write_text(
            "timestamp,prompt_tokens,output_tokens\n"
            + "".join(f"{t:.4f},{p},{o}\n" for t, p, o in rows)
        )


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_figures_equal_the_benchmarks_for_the_same_inputs(tmp_path, capsys) -> None:
    path = tmp_path / "burst.csv"
    write_burst(path)
    code = autoscale_sim.main(
        ["--trace", str(path), "--policies", POLICIES + ",all-api", "--fallback-shares", "",
         "--jobs", "1", "--load-seconds", "20", "--no-curve", "--no-plot",
         "--out", str(tmp_path / "bench"), "--json", str(tmp_path / "bench.json")]
    )  # fmt: skip
    assert code == 0
    capsys.readouterr()
    bench = json.loads((tmp_path / "bench.json").read_text())["burst"]

    # the bench's replica serves 7 req/s (its calibration for the long mix): given, not measured
    code, out, _ = run_plan(
        capsys, "--trace", str(path), "--capacity", "7", "--load-seconds", "20",
        "--policies", POLICIES, "--json",
    )  # fmt: skip
    assert code == 0
    document = json.loads(out)
    for name in POLICIES.split(","):
        mine, theirs = document["policies"][name], bench[name]
        assert mine["replica_seconds"] == theirs["replica_seconds"]
        assert mine["slo_attainment"] == theirs["attainment"]
        assert mine["cost"] == theirs["cost"]
    assert document["all_api"]["cost"] == bench["all-api"]["cost"]
    # the runs did something: the burst needed more than the one replica it started with
    assert document["policies"]["kv-queue"]["max_replicas"] > 1


def test_a_jsonl_trace_plans_as_the_same_csv(tmp_path, capsys) -> None:
    write_burst(tmp_path / "t.csv")
    write_burst(tmp_path / "t.jsonl", jsonl=True)
    documents = []
    for name in ("t.csv", "t.jsonl"):
        code, out, _ = run_plan(
            capsys, "--trace", str(tmp_path / name), "--capacity", "7", "--load-seconds", "20",
            "--policies", "kv-queue", "--json",
        )  # fmt: skip
        assert code == 0
        document = json.loads(out)
        for volatile in ("trace", "wall_s"):
            document.pop(volatile)
        documents.append(document)
    assert documents[0] == documents[1]


def test_the_oracle_and_peak_fleets_and_the_break_even(tmp_path, capsys) -> None:
    path = tmp_path / "burst.csv"
    write_burst(path)
    png = tmp_path / "plan.png"
    code, out, _ = run_plan(
        capsys, "--trace", str(path), "--capacity", "7", "--load-seconds", "20",
        "--policies", "kv-queue", "--interval", "60", "--gpu-hour-price", "3.6",
        "--api-price-per-million", "1", "--png", str(png), "--json",
    )  # fmt: skip
    assert code == 0
    document = json.loads(out)
    arrivals = traces.read_csv(path).arrivals(0)
    # a recorded trace's rate is its arrivals per minute: 30 s x 3 + 30 s x 16 = 570 in the
    # first (9.5 req/s: 2 replicas at 7), 10 s x 16 + 30 s x 3 = 250 in the second (1)
    assert document["oracle"]["replicas"] == [2, 1]
    assert document["peak_fleet"]["replicas"] == 2
    hours = document["trace"]["duration_s"] / 3600
    assert document["peak_fleet"]["cost"] == pytest.approx(2 * hours * 3.6, abs=1e-3)
    tokens = sum(a.prompt_tokens + a.output_tokens for a in arrivals)
    assert document["all_api"]["cost"] == pytest.approx(tokens / 1e6, abs=1e-4)
    even = document["break_even"]
    per_request = tokens / len(arrivals) / 1e6
    assert even["api_cost_per_request"] == pytest.approx(per_request, rel=1e-4)
    assert even["replica_cost_per_request_busy"] == pytest.approx(3.6 / 3600 / 7, rel=1e-4)
    assert even["fallback_cost_ratio"] == pytest.approx(7 * per_request / (3.6 / 3600), rel=1e-3)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_text_output_names_every_answer(tmp_path, capsys) -> None:
    path = tmp_path / "burst.csv"
    write_burst(path)
    code, out, _ = run_plan(
        capsys, "--trace", str(path), "--capacity", "7", "--load-seconds", "20",
        "--policies", POLICIES,
    )  # fmt: skip
    assert code == 0
    for phrase in ("oracle fleet", "peak fleet", "no fallback", "cost rule",
                   "all requests at the API", "break-even", "fallbackCostRatio"):  # fmt: skip
        assert phrase in out


@pytest.mark.parametrize(
    ("lines", "flags", "named"),
    [
        (['{"timestamp": 0, "prompt_tokens": 5, "output_tokens": 5}',
          '{"timestamp": 1, "prompt_tokens": 5}'], (), ":2: no output-token field"),
        (['{"timestamp": 0, "prompt_tokens": 5, "output_tokens": 5}', "[1, 2]"], (),
         ":2: expected a JSON object"),
        (['{"timestamp": 0, "prompt_tokens": 5, "output_tokens": 5}', "{oops"], (), ":2: not JSON"),
        (['{"timestamp": 0, "prompt_tokens": "many", "output_tokens": 5}',
          '{"timestamp": 1, "prompt_tokens": 5, "output_tokens": 5}'], (), ":1: prompt_tokens"),
        (['{"timestamp": 0, "prompt_tokens": 5, "output_tokens": 5}'] * 2, ("--capacity", "0"),
         "--capacity"),
        (['{"timestamp": 0, "prompt_tokens": 5, "output_tokens": 5}'] * 2,
         ("--policies", "hpa"), "--policies"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_naming_the_field(
    tmp_path, capsys, lines: list[str], flags: tuple[str, ...], named: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, out, err = run_plan(capsys, "--trace", str(path), *flags)
    assert code == 2 and out == ""
    assert named in err


def test_a_missing_trace_file_is_named(tmp_path, capsys) -> None:
    code, _, err = run_plan(capsys, "--trace", str(tmp_path / "none.csv"))
    assert code == 2 and "none.csv" in err


def test_a_stricter_slo_measures_less_capacity_per_replica(tmp_path) -> None:
    path = tmp_path / "burst.csv"
    write_burst(path)
    arrivals = traces.read_csv(path).arrivals(0)
    loose = plan.calibrate_capacity(arrivals, experiment.api.SLO(ttft_seconds=2.0))
    strict = plan.calibrate_capacity(
        arrivals, experiment.api.SLO(ttft_seconds=2.0, itl_seconds=0.03)
    )
    assert 0 < strict < loose


def manifest(tmp_path: Path, **changes: object) -> Path:
    """examples/llama-3.1-8b-gpu.yaml with its SLO at the defaults and `changes` applied."""
    import yaml

    root = Path(__file__).resolve().parents[3]
    document = yaml.safe_load((root / "examples/llama-3.1-8b-gpu.yaml").read_text())
    spec = document["spec"]
    spec["slo"] = {"ttftSeconds": 2.0, "itlSeconds": 0.1, "objective": 0.99}
    spec["autoscaling"].update(changes.pop("autoscaling", {}))
    spec["fallback"]["maxConcurrency"] = changes.pop("max_concurrency", 64)
    spec["resources"]["gpu"]["count"] = changes.pop("gpus", 1)
    if "tensor_parallel" in changes:
        spec["engine"]["tensorParallelSize"] = changes.pop("tensor_parallel")
    path = tmp_path / "llmd.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_an_llmdeployment_gives_the_spec_slo_and_gpus(tmp_path, capsys) -> None:
    trace = tmp_path / "burst.csv"
    write_burst(trace)
    path = manifest(tmp_path, autoscaling={"maxReplicas": 2}, gpus=2, tensor_parallel=2,
                    max_concurrency=8)  # fmt: skip
    common = ("--trace", str(trace), "--capacity", "7", "--load-seconds", "20", "--json")
    code, out, err = run_plan(capsys, "-f", str(path), *common, "--policies", POLICIES)
    assert code == 0, err
    document = json.loads(out)
    assert document["replica"]["gpus"] == 2
    assert all(f["max_replicas"] <= 2 for f in document["policies"].values())
    hours = document["trace"]["duration_s"] / 3600
    peak = document["peak_fleet"]
    assert peak["cost"] == pytest.approx(peak["replicas"] * hours * 2.5 * 2, abs=1e-3)
    # a flag the user gives wins over the manifest
    code, out, _ = run_plan(capsys, "-f", str(path), *common, "--policies", "kv-queue",
                            "--max-replicas", "1")  # fmt: skip
    assert code == 0 and json.loads(out)["policies"]["kv-queue"]["max_replicas"] == 1


def test_a_bad_llmdeployment_is_refused_naming_the_field(tmp_path, capsys) -> None:
    trace = tmp_path / "burst.csv"
    write_burst(trace)
    path = manifest(tmp_path, autoscaling={"fallbackCostRatio": -1})
    code, out, err = run_plan(capsys, "-f", str(path), "--trace", str(trace))
    assert code == 2 and out == "" and "fallbackCostRatio" in err
