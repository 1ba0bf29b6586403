"""`kubellm plan --trace --pd`: whether P/D pays on a trace and at which P:D, from the P/D
bench's simulation (`kubellm.simulation.pd`, the gateway's own `disagg.decide`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kubellm import cli
from kubellm.simulation import pd


@pytest.mark.parametrize(
    ("aggregated", "split", "pays", "best"),
    [
        (10.0, {1: 10.2, 2: 10.4}, False, 2),  # under PAYS x aggregated: keep it aggregated
        (10.0, {1: 10.6, 2: 12.0, 3: 11.0}, True, 2),  # the best P:D
        (10.0, {1: 12.0, 2: 12.0}, True, 1),  # ties: fewer prefill replicas
        (0.0, {1: 0.0}, False, 1),  # nothing serves the SLO
        (5.0, {}, False, None),  # one replica: nothing to split
    ],
)
def test_the_verdict_is_the_best_split_against_aggregated(aggregated, split, pays, best) -> None:
    assert pd.verdict(aggregated, split) == (pays, best)


@pytest.mark.parametrize(
    ("replicas", "expected"),
    [(1, []), (2, [1]), (4, [1, 2, 3]), (8, [1, 2, 3, 4, 5, 6, 7]), (16, [1, 3, 6, 8, 10, 13, 15])],
)
def test_the_sweep_spreads_the_prefill_counts(replicas: int, expected: list[int]) -> None:
    assert pd.sweep(replicas) == expected


def write_trace(path: Path) -> None:
    """Long prompts (4-12k tokens), 100-400 token answers, 2 req/s."""
    rng, t, rows = random.Random(1), 0.0, ["timestamp,prompt_tokens,output_tokens"]
    for _ in range(120):
        t += rng.expovariate(2.0)
        rows.append(f"{t:.3f},{rng.randint(4096, 12000)},{rng.randint(100, 400)}")
    path.write_text("\n".join(rows) + "\n")


def test_plan_says_whether_pd_pays_and_at_which_ratio(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "rag.csv"
    write_trace(trace)
    common = ["plan", "--trace", str(trace), "--capacity", "2", "--policies", "kv-queue",
              "--itl", "0.03", "--pd", "3"]  # fmt: skip
    assert cli.main([*common, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["pd"]
    split = {int(k): v for k, v in found["conditional_x"].items()}
    assert sorted(split) == [1, 2] and found["replicas"] == 3
    assert 0 < found["aggregated_x"] <= found["bound_x"]
    assert all(0 <= v <= found["bound_x"] for v in split.values())
    pays, best = pd.verdict(found["aggregated_x"], split)
    assert (found["pays"], found["prefill"]) == (pays, best if pays else 0)
    assert found["prefill"] + found["decode"] == 3
    assert cli.main(common) == 0
    out = capsys.readouterr().out
    assert "P/D on 3 replicas" in out
    assert ("P/D pays on this trace" in out) == found["pays"]


def test_pd_needs_two_replicas_and_a_positive_link(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "rag.csv"
    write_trace(trace)
    for flags, named in ((["--pd", "1"], "--pd"), (["--pd", "2", "--pd-link-gbps", "0"],
                                                    "--pd-link-gbps")):  # fmt: skip
        assert cli.main(["plan", "--trace", str(trace), *flags]) == 2
        assert named in capsys.readouterr().err
