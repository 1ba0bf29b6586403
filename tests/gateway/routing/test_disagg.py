"""The split decision (routing/disagg.py): table tests on the pure part, and the plan
built from the latency model's state."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kubellm.gateway.discovery.base import PrefillSplit
from kubellm.gateway.routing.disagg import REASONS, Inputs, decide, plan
from kubellm.gateway.routing.latency.predictions import CHARS_PER_TOKEN, Predictions
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest

# Llama 3.1 8B on an H100 (engine_image/sim_profiles.py), 30 ms ITL, 2 s TTFT targets
BASE = Inputs(
    prompt_tokens=12_000,
    uncached_tokens=12_000,
    local_ttft=0.45,
    decode_step_s=0.007 + 80e-6 * 40,
    others_itl=0.045,  # 40 streams there, their mean ITL with this prompt computed beside them
    prefill_token_s=32e-6,
    step_tokens=8192,
    prefill_ttft=0.40,
    kv_bytes_per_token=131_072,
    link_bytes_per_s=45e9,
    ttft_target=2.0,
    itl_target=0.030,
)

SEVENTY = Inputs(
    prompt_tokens=10_000,
    uncached_tokens=10_000,
    local_ttft=0.90,
    decode_step_s=0.015,
    others_itl=0.020,
    prefill_token_s=86e-6,
    step_tokens=8192,
    prefill_ttft=1.30,
    kv_bytes_per_token=327_680,
    link_bytes_per_s=45e9,
    ttft_target=2.0,
    itl_target=0.030,
    answer_tokens=150,
)

# SEVENTY with 20 streams there at 28 ms (33.7 ms with the stall) and the prefill pool busy:
# the split's TTFT 2.29 s (2.2 s on its prefill replica, one prompt queued there)
PAST = replace(SEVENTY, others_itl=0.028, prefill_ttft=2.2, streams=20.0, prefill_queued=1.0)

CASES = {
    "long uncached prompt, busy decode replica": (BASE, True, "itl-harm"),
    "short prompt": (replace(BASE, prompt_tokens=60, uncached_tokens=60), False, "short-prompt"),
    "cached prefix on the decode replica": (
        replace(BASE, uncached_tokens=40), False, "cached-prefix"),
    "mostly cached, harmless remainder": (  # the streams' ITL is the step's either way
        replace(BASE, uncached_tokens=300, local_ttft=0.03, others_itl=BASE.decode_step_s),
        False, "cached-prefix"),
    "split 10% better, margin 0.2": (  # answers long enough that the stall spreads thin
        replace(BASE, others_itl=0.0113, answer_tokens=4000, margin=0.2), False, "no-gain"),
    "split 10% better, margin 0": (
        replace(BASE, others_itl=0.0113, answer_tokens=4000, margin=0.0), True, "itl-harm"),
    "busy prefill pool": (replace(BASE, prefill_ttft=3.5), False, "prefill-busy"),
    "no prefill replica ready": (replace(BASE, prefill_ttft=None), False, "no-prefill-replica"),
    "idle decode replica, prefill no faster": (
        replace(BASE, others_itl=0.0), False, "no-gain"),
    "idle decode replica, prefill much faster": (
        replace(BASE, others_itl=0.0, local_ttft=2.5), True, "faster-ttft"),
    "always, even a short prompt": (
        replace(BASE, prompt_tokens=60, uncached_tokens=60, split="Always"), True, "always"),
    "always, but no prefill replica": (
        replace(BASE, prefill_ttft=None, split="Always"), False, "no-prefill-replica"),
    # 70B on 4 x H100: a 10k prompt computed locally stalls the streams there 0.86 s; their
    # mean ITL reads 20 ms (0.67 of the target) but the stall adds 5.7 ms to an answer of
    # 150 tokens (0.86): the split's 0.69 (its TTFT on a busier prefill replica) is better
    "long prompt, the streams' mean ITL under target but not with its stall": (
        SEVENTY, True, "itl-harm"),
    "the same prompt beside no streams: nobody to stall": (
        replace(SEVENTY, others_itl=0.0), False, "no-gain"),
    "the same prompt beside streams with long answers": (
        replace(SEVENTY, answer_tokens=2000), False, "no-gain"),
    "slow link: the transfer makes the split miss its TTFT": (
        replace(BASE, link_bytes_per_s=0.5e9), False, "prefill-busy"),
    # both sides past a target (summed excess): a local prefill pushes 20 streams 12% past
    # the ITL target (20 x 0.12), the split this request 14% past its TTFT target behind one
    # queued prompt (2 x 0.14): split, where the point cost (1.14 against 1.12) kept it local
    "both past a target, many streams there: split": (PAST, True, "itl-harm"),
    "both past a target, two streams, three prompts queued on the prefill replica": (
        replace(PAST, streams=2.0, prefill_queued=3.0), False, "prefill-busy"),
    "the split past its TTFT target, the streams within theirs: local": (
        replace(PAST, others_itl=0.020), False, "prefill-busy"),
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_decision_table(name: str) -> None:
    inputs, split, reason = CASES[name]
    verdict = decide(inputs)
    assert (verdict.split, verdict.reason) == (split, reason)
    assert verdict.reason in REASONS


def test_transfer_is_bytes_over_bandwidth() -> None:
    verdict = decide(BASE)
    assert verdict.transfer_s == pytest.approx(131_072 * 12_000 / 45e9)
    assert verdict.split_ttft == pytest.approx(0.40 + verdict.transfer_s + BASE.decode_step_s)


def test_the_local_harm_is_the_streams_itl_with_the_stall_spread_over_an_answer() -> None:
    verdict = decide(SEVENTY)
    assert verdict.local_itl_harm == pytest.approx(0.020 + 10_000 * 86e-6 / 150)


def _request(tokens: int) -> RoutingRequest:
    return RoutingRequest("m", prompt_chars=tokens * CHARS_PER_TOKEN)


def test_plan_picks_the_least_loaded_prefill_replica_and_splits_a_long_prompt() -> None:
    predictions = Predictions()
    decode = Candidate("http://d", in_flight=40, running=40.0, waiting=0.0)
    # prompts sent there lately: ~20k tokens/s, 64% of its time (the latency model's busy)
    predictions.prefill_rate(decode.url, add=100_000)
    prefills = [
        Candidate("http://p-busy", in_flight=3, running=3.0, waiting=6.0),
        Candidate("http://p-idle", running=0.0, waiting=0.0),
    ]
    verdict, url = plan(predictions, _request(12_000), decode, prefills, PrefillSplit(), 2.0, 0.030)
    assert verdict.split and url == "http://p-idle"
    short, url = plan(predictions, _request(50), decode, prefills, PrefillSplit(), 2.0, 0.030)
    assert not short.split and url is None and short.reason == "short-prompt"
    alone, _ = plan(predictions, _request(12_000), decode, [], PrefillSplit(), 2.0, 0.030)
    assert (alone.split, alone.reason) == (False, "no-prefill-replica")


def test_a_long_prompt_splits_by_its_stall_where_the_streams_mean_itl_alone_would_not() -> None:
    """Beside 40 streams one 12k prompt moves their mean ITL 10 -> 11 ms; its stall (0.38 s)
    spread over answers of 150 tokens adds 2.5 ms more: the split is predicted 25% better,
    which a margin of 0.1 takes too. With answers lately of 5,000 tokens the stall spreads
    thin (11.2 ms): 8% better, which the shipped margin of 0 takes and 0.1 does not."""
    predictions = Predictions()
    predictions.answer_tokens = 150
    decode = Candidate("http://d", in_flight=40, running=40.0, waiting=0.0)
    prefills = [Candidate("http://p", running=0.0, waiting=0.0)]
    request = _request(12_000)
    verdict, url = plan(predictions, request, decode, prefills, PrefillSplit(margin=0.1), 2.0, 0.03)
    assert (verdict.split, verdict.reason, url) == (True, "itl-harm", "http://p")
    predictions.answer_tokens = 5000
    decode = Candidate("http://d", in_flight=40, running=40.0, waiting=0.0)
    prefills = [Candidate("http://p", running=0.0, waiting=0.0)]
    request = _request(12_000)
    verdict, url = plan(predictions, request, decode, prefills, PrefillSplit(), 2.0, 0.030)
    assert (verdict.split, url) == (True, "http://p") and verdict.local_itl_harm < 0.030
    kept, url = plan(predictions, request, decode, prefills, PrefillSplit(margin=0.1), 2.0, 0.03)
    assert (kept.split, kept.reason, url) == (False, "no-gain", None)


def test_past_a_target_the_excess_is_summed_over_the_requests_that_carry_it() -> None:
    # the point cost alone (no streams, no queue counted) keeps PAST local
    alone = decide(replace(PAST, streams=0.0, prefill_queued=0.0))
    assert (alone.split, alone.reason) == (False, "prefill-busy")
    # the local side's excess grows with the streams it stalls, the split's with the queue
    assert decide(replace(PAST, streams=3.0, prefill_queued=1.0)).split
    assert not decide(replace(PAST, streams=2.0, prefill_queued=1.0)).split


def test_plan_reads_the_streams_and_the_chosen_prefill_replicas_queue(monkeypatch) -> None:
    import kubellm.gateway.routing.disagg as disagg

    seen: list[Inputs] = []
    real = disagg.decide
    monkeypatch.setattr(disagg, "decide", lambda x: seen.append(x) or real(x))
    decode = Candidate("http://d", in_flight=40, running=40.0, waiting=0.0)
    prefills = [
        Candidate("http://p-busy", in_flight=0, running=3.0, waiting=6.0),
        Candidate("http://p-idle", in_flight=0, running=0.0, waiting=1.0),
    ]
    plan(Predictions(), _request(12_000), decode, prefills, PrefillSplit(), 2.0, 0.030)
    (x,) = seen
    assert x.streams == 40.0  # the 40 running there (the batch less this request)
    assert x.prefill_queued == 1.0  # p-idle's one waiting prompt (another gateway's)
