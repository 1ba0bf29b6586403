"""The kubellm command: plan, crds, validate, and help for every subcommand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kubellm import cli, crd

ROOT = Path(__file__).resolve().parents[2]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_for_the_lesson_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "plan", "--layers", "32", "--kv-heads", "32", "--head-dim", "128",
        "--params-billions", "7", "--weights-gib", "13", "--gpu-memory-gib", "80",
        "--usable-fraction", "0.9", "--bandwidth-gbps", "2000", "--gpu-hour-price", "2",
        "--context-tokens", "4096", "--throughput-tokens-per-second", "1000",
        "--utilization", "0.3", "--json",
    )  # fmt: skip
    assert code == 0
    result = json.loads(out)
    assert result["kv_bytes_per_token"] == 524_288
    assert result["kv_bytes_per_request"] == 2 * 2**30
    assert result["weight_bytes"] == 13 * 2**30
    assert result["kv_pool_bytes"] == 59 * 2**30
    assert result["max_concurrent_sequences"] == 29
    assert round(result["cost_per_million_tokens"], 2) == 1.85


def test_plan_model_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, _ = run(
        capsys, "plan", "--model-config", str(path), "--context-tokens", "8192",
        "--concurrency", "100", "--json",
    )  # fmt: skip
    result = json.loads(out)
    assert code == 0
    assert result["kv_bytes_per_token"] == 131_072
    assert result["max_concurrent_sequences"] == 57
    assert result["replicas_needed"] == 2
    assert "cost_per_million_tokens" not in result  # no price given


def test_plan_table_is_readable(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--model", "llama-3.1-8b", "--context-tokens", "8192")
    assert code == 0
    assert "131,072 B" in out and "concurrent sequences per replica" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-3.1-70b"], "quantize"),
        (["--model", "llama-2-7b", "--context-tokens", "8192"], "lower --context-tokens"),
        (["--layers", "32"], "--kv-heads"),
        (["--model-config", "/nonexistent/config.json"], "cannot read model config"),
    ],
)
def test_plan_impossible_inputs_say_what_to_change(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = run(capsys, "plan", *argv)
    assert code == 1
    assert message in err


def test_crds_writes_the_generated_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, _ = run(capsys, "crds", "--output-dir", str(tmp_path))
    assert code == 0
    assert (tmp_path / crd.CRD_FILENAME).read_text() == crd.render()


def test_validate_reports_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    bad = ROOT / "examples" / "invalid" / "min-over-max.yaml"
    good = ROOT / "examples" / "tiny-cpu.yaml"
    code, out, err = run(capsys, "validate", "-f", str(good), "-f", str(bad))
    assert code == 1
    assert "tiny is a valid LLMDeployment" in out
    assert "spec.autoscaling.minReplicas" in err


@pytest.mark.parametrize("command", [*sorted(cli.COMPONENT_COMMANDS), "crds", "plan", "validate"])
def test_every_subcommand_has_help(command: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kubellm.cli", command, "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "usage: kubellm" in result.stdout
    assert len(result.stdout.splitlines()) > 2


def test_plan_compares_shapes_across_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "plan", "--model", "llama-3.1-405b", "--compare-shapes", "8",
        "--max-nodes", "2", "--context-tokens", "8192", "--bandwidth-gbps", "3350",
    )  # fmt: skip
    assert code == 0
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in row] for row in rows[2:]]  # past the header
    one_node = [row for row in rows if row[0] == "1"]
    assert one_node and all("do not fit" in row[3] for row in one_node)
    two = {(row[1], row[2]): float(row[7]) for row in rows if row[0] == "2"}
    assert two["8", "2"] > two["4", "4"] > two["2", "8"]  # TP inside a node is the speed
    assert "TP 8 x PP 2" in out.splitlines()[-1]
