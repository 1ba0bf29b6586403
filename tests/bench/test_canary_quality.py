"""bench/canary_quality's tables from a run's figures (the engines' part needs real vLLM)."""

from __future__ import annotations

from bench.gateway import canary_quality


def _run(verdict: str, agreement: float, real: int, **extra: object) -> dict[str, object]:
    return {"verdict": verdict, "shadow_mirrored": 52, "shadow_real": 0, "real": real,
            "shadow_verdict": "Pass" if verdict == "Promoted" else "Fail",
            "agreement": agreement, "token_agreement": agreement, "divergence": None,
            **extra}  # fmt: skip


def test_the_tables_count_verdicts_and_list_every_run():
    out = {"revisions": {
        "same": {"runs": [_run("Promoted", 1.0, 70), _run("Promoted", 1.0, 64)]},
        "4bit": {"runs": [_run("RolledBack", 0.4, 0, reason="CanaryAnswersDiffer", step=1)]},
    }}  # fmt: skip
    rows = canary_quality.tables(out)
    summary = {r.split(" | ")[0].strip("| "): r.split(" | ") for r in rows[2:4]}
    assert summary["same"][5:8] == ["2", "0", "0"]  # promoted, rolled back, inconclusive
    assert summary["4bit"][4:8] == ["0/1", "0", "1", "0"]
    runs = [r for r in rows[rows.index("") + 3 :]]
    assert len(runs) == 3
    assert (
        "| 4bit | 1 | 0.400 | 0.400 | - | Fail | RolledBack (CanaryAnswersDiffer, step 1) |"
        in (runs[2])
    )
    assert runs[0].endswith("| 52 | 0 | 70 |")
