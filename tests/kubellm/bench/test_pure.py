"""kubellm bench's pure parts: arrivals, workloads, statistics, the table and the charts."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from pathlib import Path

import pytest

from kubellm.bench import report, runner, stats, workloads
from kubellm.bench.stats import RequestResult


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_have_the_asked_rate_and_burstiness(burstiness: float) -> None:
    times = runner.arrival_times(4000, rate=10.0, burstiness=burstiness, seed=7)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] > 0.0 and all(g >= 0 for g in gaps)
    assert times[-1] == pytest.approx(4000 / 10.0)  # rescaled: the asked rate on average
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.08)
    # gamma(shape k): squared coefficient of variation is 1/k (1 for Poisson)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.15)


def test_infinite_rate_sends_everything_at_once_and_bad_rates_are_refused() -> None:
    assert runner.arrival_times(5, math.inf, 1.0, 0) == [0.0] * 5
    with pytest.raises(ValueError, match="--burstiness"):
        runner.arrival_times(5, 1.0, 0.0, 0)
    with pytest.raises(ValueError, match="--rate"):
        runner.arrival_times(5, 0.0, 1.0, 0)


def test_random_workload_lengths_stay_in_their_ranges() -> None:
    spec = workloads.WorkloadSpec(num_requests=50, input_len=(10, 20), output_len=(3, 9))
    convs = workloads.build(spec)
    assert len(convs) == 50 and all(len(c.turns) == 1 and not c.chat for c in convs)
    for c in convs:
        turn = c.turns[0]
        assert 10 <= turn.prompt_tokens <= 20 and 3 <= turn.max_tokens <= 9
        assert len(turn.prompt.split()) == turn.prompt_tokens  # one word per intended token
    assert len({c.turns[0].max_tokens for c in convs}) > 1
    assert workloads.build(spec) == convs  # seeded: reproducible


def test_shared_prefix_workload_reuses_exactly_n_prefixes() -> None:
    spec = workloads.WorkloadSpec(
        kind="shared-prefix", num_requests=12, num_prefixes=3, prefix_len=40, suffix_len=5
    )
    prompts = [c.turns[0].prompt.split() for c in workloads.build(spec)]
    prefixes = {" ".join(p[:40]) for p in prompts}
    assert len(prefixes) == 3
    assert len({" ".join(p) for p in prompts}) == 12  # suffixes differ
    assert all(len(p) == 45 for p in prompts)


def test_multi_turn_workload_splits_requests_into_chat_sessions() -> None:
    spec = workloads.WorkloadSpec(kind="multi-turn", num_requests=10, turns=4)
    convs = workloads.build(spec)
    assert [len(c.turns) for c in convs] == [4, 4, 2]
    assert all(c.chat for c in convs)
    assert workloads.count_requests(convs) == 10


def test_trace_replay_reads_prompts_lengths_messages_and_relative_timestamps(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 100.0, "prompt": "hello there", "output_len": 5},
        {"timestamp": 100.5, "input_len": 7},
        {
            "timestamp": 102.0,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
            ],
            "max_tokens": 3,
        },
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    spec = workloads.WorkloadSpec(kind="trace", trace=str(trace), output_len=(11, 11))
    convs = workloads.build(spec)
    assert [c.at for c in convs] == [0.0, 0.5, 2.0]
    assert convs[0].turns[0].prompt == "hello there" and convs[0].turns[0].max_tokens == 5
    assert convs[1].turns[0].prompt_tokens == 7 and convs[1].turns[0].max_tokens == 11
    assert (
        convs[2].chat
        and convs[2].history == (("system", "be brief"),)
        and convs[2].turns[0].prompt == "hi"
    )


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("not json", "not JSON"),
        ('{"output_len": 3}', "prompt, input_len or messages"),
        ('{"prompt": "x", "output_len": 0}', "output_len"),
        ('{"prompt": "x", "timestamp": "soon"}', "timestamp"),
    ],
)
def test_bad_trace_lines_are_named(tmp_path: Path, line: str, field: str) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(line + "\n")
    with pytest.raises(workloads.BenchError, match=f"bad.jsonl:1: .*{field}"):
        workloads.build(workloads.WorkloadSpec(kind="trace", trace=str(trace)))


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (workloads.WorkloadSpec(num_requests=0), "--num-requests"),
        (workloads.WorkloadSpec(input_len=(5, 2)), "--input-len"),
        (workloads.WorkloadSpec(kind="shared-prefix", num_prefixes=0), "--num-prefixes"),
        (workloads.WorkloadSpec(kind="trace"), "--trace"),
        (workloads.WorkloadSpec(kind="nope"), "--workload"),
    ],
)
def test_bad_workload_settings_name_the_option(spec: workloads.WorkloadSpec, field: str) -> None:
    with pytest.raises(workloads.BenchError, match=field):
        workloads.build(spec)


def test_percentile_matches_linear_interpolation() -> None:
    values = [random.Random(3).random() for _ in range(101)]
    ordered = sorted(values)
    assert stats.percentile(values, 50) == ordered[50]
    assert stats.percentile([1.0, 2.0], 50) == 1.5
    assert stats.percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert stats.percentile([], 50) is None


def test_summary_counts_throughput_tpot_and_distserve_goodput() -> None:
    fast = RequestResult(ok=True, ttft=0.1, itls=[0.01] * 9, e2e=0.19, output_tokens=10)
    slow_first = RequestResult(ok=True, ttft=3.0, itls=[0.01] * 9, e2e=3.09, output_tokens=10)
    slow_stream = RequestResult(ok=True, ttft=0.1, itls=[0.5] * 4, e2e=2.1, output_tokens=5)
    failed = RequestResult(ok=False, error="HTTP 500: boom\ntrace")
    too_long = [RequestResult(ok=False, error=f"HTTP 400: {n} tokens") for n in (1025, 1100)]
    s = stats.summarize(
        [fast, slow_first, slow_stream, failed, *too_long], 2.0, ttft_target=1.0, itl_target=0.1
    )
    assert (s["requests"], s["completed"], s["failed"]) == (6, 3, 3)
    assert s["errors"] == {"HTTP 500: boom": 1, "HTTP 400: N tokens": 2}
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(12.5)
    assert s["tpot_s"]["p50"] == pytest.approx(0.01)  # (0.19-0.1)/9, (3.09-3)/9, 2.0/4
    assert s["tpot_s"]["mean"] == pytest.approx((0.01 + 0.01 + 0.5) / 3)
    assert s["ttft_s"]["p50"] == pytest.approx(0.1)
    assert s["itl_s"]["p99"] == pytest.approx(0.5)
    good = s["goodput"]
    assert good["good_requests"] == 1 and good["share"] == pytest.approx(1 / 6)
    assert good["rate"] == 0.5


def test_goodput_is_absent_without_targets_and_table_shows_each_run() -> None:
    ok = RequestResult(ok=True, ttft=0.2, itls=[0.02], e2e=0.22, output_tokens=2)
    runs = [stats.summarize([ok], 1.0, label={"rate": r, "concurrency": None}) for r in (1, 2)]
    assert "goodput" not in runs[0]
    text = report.table(runs)
    lines = text.splitlines()
    assert lines[0].startswith("LOAD") and lines[1].startswith("1/s") and lines[2].startswith("2/s")
    assert "200.0/200.0" in lines[1]  # TTFT p50/p99 in ms


def test_plot_writes_a_png(tmp_path: Path) -> None:
    ok = RequestResult(ok=True, ttft=0.2, itls=[0.02, 0.03], e2e=0.25, output_tokens=3)
    runs = [
        stats.summarize(
            [ok], 1.0 / r, ttft_target=1, itl_target=0.1, label={"rate": r, "concurrency": None}
        )
        for r in (1, 2, 4)
    ]
    out = tmp_path / "charts" / "bench.png"
    report.plot(runs, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_local_tokenizer_gives_prompts_of_exact_length(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    make = workloads.tokenizer_text(tokenizer)
    spec = workloads.WorkloadSpec(num_requests=8, input_len=(20, 60))
    offs = []
    for conv in workloads.build(spec, make):
        turn = conv.turns[0]
        got = len(tokenizer.encode(turn.prompt, add_special_tokens=False))
        offs.append(abs(got - turn.prompt_tokens))
    assert max(offs) <= 2 and offs.count(0) >= 6  # exact, bar an unsettled round trip


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ("HTTP 400: 1025 tokens > 1024", "HTTP 400: N tokens > N"),
        ("Cannot connect to host 10.0.0.7:8080 ssl:default [Connect call failed "
         "('10.0.0.7', 8080)]",
         "Cannot connect to host 10.0.0.7:8080 ssl:default [Connect call failed "
         "('10.0.0.7', 8080)]"),
        ("Cannot connect to host gw.local:443 [Errno 111] refused",
         "Cannot connect to host gw.local:443 [Errno 111] refused"),
        ("HTTP 429: busy, retry after 3 s", "HTTP 429: busy, retry after 3 s"),
        ("HTTP 503: queue full for 12 requests (Retry-After: 5)",
         "HTTP 503: queue full for N requests (Retry-After: 5)"),
        ("HTTP 502: http://127.0.0.1:4001/v1/completions answered 500",
         "HTTP 502: http://127.0.0.1:4001/v1/completions answered N"),
    ],
)  # fmt: skip
def test_error_kinds_keep_addresses_and_retry_after(error: str, kind: str) -> None:
    assert stats.error_kind(error) == kind
