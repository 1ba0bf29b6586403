"""Recorded trace files as `kubellm plan --trace` reads them: a stamp that is not a finite
number, or one that stretches the trace past the span a plan simulates, is refused naming
its line before anything is allocated for the span; so are sizes that cannot be counted and
a `--rate-scale` that would multiply the requests without bound."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from kubellm import cli
from kubellm.simulation import traces

GOOD = [(0.0, 100, 10), (1.0, 100, 10), (2.0, 100, 10)]
MEMORY_BOUND = 16 * 1024 * 1024  # a few rows' worth, far under it


def _csv(path: Path, rows: list[tuple[object, object, object]]) -> Path:
    path.write_text(
        "timestamp,prompt_tokens,output_tokens\n" + "".join(f"{t},{p},{o}\n" for t, p, o in rows)
    )
    return path


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _row(stamp: str) -> str:
    return f'{{"timestamp": {stamp}, "prompt_tokens": 5, "output_tokens": 5}}'


@pytest.mark.parametrize(
    ("rows", "named"),
    [
        ([*GOOD, ("inf", 100, 10)], ":5: timestamp (timestamp): cannot read 'inf' (not a finite"),
        ([("nan", 100, 10), *GOOD], ":2: timestamp (timestamp): cannot read 'nan' (not a finite"),
        ([*GOOD, ("-inf", 100, 10)], ":5: timestamp"),
        ([*GOOD, (3.0, "inf", 10)], ":5: prompt_tokens (prompt tokens): cannot read 'inf'"),
        ([*GOOD, (3.0, 100, "1e400")], ":5: output_tokens (output tokens): cannot read '1e400'"),
        ([*GOOD, (1e11, 100, 10)], ":5: its timestamp is 1e+11 s after the earliest request's "
                                   "(line 2); a trace may span at most 2678400 s"),
        ([(-1e9, 100, 10), *GOOD], ":5: its timestamp is 1e+09 s after the earliest request's "
                                   "(line 2)"),
        ([*GOOD, ("9999-12-31T23:59:59", 100, 10)], ":5: its timestamp is"),
        ([*GOOD, ("x" * 200_000, 100, 10)], ":5: field larger than field limit"),
    ],
)  # fmt: skip
def test_a_bad_csv_row_is_refused_naming_its_line(
    tmp_path: Path, rows: list[tuple[object, object, object]], named: str
) -> None:
    path = _csv(tmp_path / "t.csv", rows)
    tracemalloc.start()
    try:
        with pytest.raises(traces.TraceError) as caught:
            traces.read_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert named in str(caught.value) and str(path) in str(caught.value)
    assert peak < MEMORY_BOUND, f"peak {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    ("lines", "named"),
    [
        ([_row("0"), _row("NaN")], ":2: timestamp (timestamp): cannot read 'nan' (not a finite"),
        ([_row("Infinity"), _row("0")], ":1: timestamp (timestamp): cannot read 'inf'"),
        ([_row("0"), _row('"inf"')], ":2: timestamp"),
        ([_row("0"), _row("1" + "0" * 400)], ":2: timestamp"),  # an integer past a float
        ([_row("0"), '{"timestamp": 1, "prompt_tokens": 1e999, "output_tokens": 5}'],
         ":2: prompt_tokens (prompt-token): cannot read 'inf'"),
        ([_row("0"), _row("1e11")], ":2: its timestamp is 1e+11 s"),
    ],
)  # fmt: skip
def test_a_bad_jsonl_line_is_refused_naming_it(
    tmp_path: Path, lines: list[str], named: str
) -> None:
    path = _jsonl(tmp_path / "t.jsonl", lines)
    with pytest.raises(traces.TraceError) as caught:
        traces.read_file(path)
    assert named in str(caught.value)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--rate-scale", "inf"), "--rate-scale must be above 0 and at most 1000"),
        (("--rate-scale", "nan"), "--rate-scale must be"),
        (("--rate-scale", "1e9"), "--rate-scale must be above 0 and at most 1000"),
    ],
)
def test_plan_refuses_a_rate_scale_without_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], named: str
) -> None:
    path = _csv(tmp_path / "t.csv", GOOD)
    code = cli.main(["plan", "--trace", str(path), *flags])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and named in err


def test_plan_names_the_stray_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _csv(tmp_path / "t.csv", [*GOOD, (1e11, 100, 10)])
    code = cli.main(["plan", "--trace", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("kubellm plan: --trace: ") and "t.csv:5: its timestamp" in err


def test_a_trace_within_the_bounds_reads_as_written(tmp_path: Path) -> None:
    rows = [(0.0, 100, 10), (traces.MAX_SPAN_SECONDS, 200, 20)]
    trace = traces.read_file(_csv(tmp_path / "t.csv", rows))
    assert [(a.time, a.prompt_tokens, a.output_tokens) for a in trace.arrivals(0)] == rows
    keys = ("time", "input_tokens", "output_tokens")
    lines = [json.dumps(dict(zip(keys, row, strict=True))) for row in rows]
    back = traces.read_file(_jsonl(tmp_path / "t.jsonl", lines))
    assert back.recorded == trace.recorded
