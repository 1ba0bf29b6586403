"""`kubellm plan` refuses each impossible input, naming the flag and what to change."""

from __future__ import annotations

import json

import pytest

from kubellm import capacity, cli


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(["plan", *argv])
    except SystemExit as exit_:  # argparse refuses a flag's value with status 2
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "flag", "change"),
    [
        (["--tensor-parallel", "0"], "--tensor-parallel", "at least 1"),
        (["--tensor-parallel", "-2"], "--tensor-parallel", "at least 1"),
        (["--gpu-memory-gib", "-5"], "--gpu-memory-gib", "more than 0"),
        (["--gpu-memory-gib", "0"], "--gpu-memory-gib", "more than 0"),
        (["--gpu-memory-gib", "inf"], "--gpu-memory-gib", "finite"),
        (["--usable-fraction", "1.5"], "--usable-fraction", "at most 1"),
        (["--usable-fraction", "nan"], "--usable-fraction", "finite"),
        (["--utilization", "0"], "--utilization", "more than 0"),
        (["--concurrency", "0"], "--concurrency", "at least 1"),
        (["--context-tokens", "0"], "--context-tokens", "at least 1"),
        (["--context-tokens", "4k"], "--context-tokens", "not an integer"),
        (["--bandwidth-gbps", "-1"], "--bandwidth-gbps", "more than 0"),
        (["--gpu-hour-price", "-2"], "--gpu-hour-price", "more than 0"),
        (["--throughput-tokens-per-second", "0"], "--throughput-tokens-per-second", "more than 0"),
        (["--api-price-per-million", "0"], "--api-price-per-million", "more than 0"),
        (["--weights-gib", "-1"], "--weights-gib", "more than 0"),
    ],
)
def test_flag_values_out_of_range_are_refused_by_name(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str, change: str
) -> None:
    code, out, err = run(capsys, "--model", "llama-3.1-8b", *argv)
    assert code == 2
    assert out == ""
    assert f"argument {flag}: must be" in err or f"argument {flag}: '" in err, err
    assert change in err
    assert "Traceback" not in err


def test_tensor_parallel_must_divide_the_attention_heads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, "--model", "llama-3.1-70b", "--tensor-parallel", "3")
    assert code == 1
    assert "does not divide the model's 64 attention heads" in err
    assert "use one of 1, 2, 4, 8, 16" in err
    code, out, _ = run(capsys, "--model", "llama-3.1-70b", "--tensor-parallel", "4")
    assert code == 0 and "x 4 GPU" in out


def test_attention_heads_can_be_given_with_explicit_numbers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shape = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--params-billions", "7"]
    code, _, err = run(capsys, *shape, "--attention-heads", "64", "--tensor-parallel", "3")
    assert code == 1 and "64 attention heads" in err
    # Without it, the KV heads are still checked: 3 neither divides 8 nor is divided by it.
    code, _, err = run(capsys, *shape, "--tensor-parallel", "3")
    assert code == 1 and "8 KV heads" in err


def test_weights_gib_stands_in_for_params(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128"]
    code, out, err = run(capsys, *shape, "--weights-gib", "15", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["weight_bytes"] == 15 * capacity.GIB
    # 80 GiB x 0.9 - 15 GiB = 57 GiB of KV pool; 0.5 GiB per 4,096-token request.
    assert result["max_concurrent_sequences"] == 114
    code, _, err = run(capsys, *shape)
    assert code == 1 and "--params-billions (or --weights-gib)" in err


def test_break_even_above_100_percent_says_the_api_always_wins(
    capsys: pytest.CaptureFixture[str],
) -> None:
    costs = ["--gpu-hour-price", "10", "--throughput-tokens-per-second", "100"]
    code, out, _ = run(capsys, "--model", "llama-3.1-8b", *costs, "--api-price-per-million", "1")
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("break-even"))
    assert "never: the API is cheaper at any utilization" in line
    assert "27.8x" in line
    code, out, _ = run(capsys, "--model", "llama-3.1-8b", *costs, "--api-price-per-million", "50")
    line = next(line for line in out.splitlines() if line.startswith("break-even"))
    assert line.endswith("56%")


def test_plan_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    assert "(default: 4096)" in out and "(default: 0.9)" in out
