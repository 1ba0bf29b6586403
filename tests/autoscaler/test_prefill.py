"""The prefill role's autoscaling decisions and the pair's coordination (pure)."""

from __future__ import annotations

import pytest
from kubellm.autoscaler.prefill import (
    PrefillObservation,
    PrefillSignals,
    coordinate,
    decide,
    learn_throughput,
    prefill_ask,
    stabilised,
)

from kubellm import api

SPEC = api.PrefillAutoscaling(minReplicas=1, maxReplicas=8, targetQueueShare=0.5)


@pytest.mark.parametrize(
    ("queued", "running", "tps", "current", "expected"),
    [
        (0, 0, 10_000, 3, 1),  # idle: down to the minimum
        (9_000, 1_000, 10_000, 1, 1),  # 10k tokens = 1 s of work; budget 0.5 x 2 s = 1 s
        (10_001, 0, 10_000, 1, 2),  # just over one replica's budget
        (45_000, 5_000, 10_000, 2, 5),  # 5 s of work over 1 s budgets
        (10**9, 0, 10_000, 2, 8),  # capped at maxReplicas
        (50_000, 0, 0, 3, 3),  # no throughput measured: hold the current count
    ],
)
def test_prefill_ask_is_queued_work_over_the_ttft_budget(queued, running, tps, current, expected):
    signals = PrefillSignals(queued, running, tps, current)
    assert prefill_ask(signals, SPEC, ttft_seconds=2.0) == expected


def test_a_tighter_ttft_budget_asks_for_more_prefill_replicas() -> None:
    signals = PrefillSignals(40_000, 0, 10_000, 1)
    assert prefill_ask(signals, SPEC, ttft_seconds=0.5) > prefill_ask(signals, SPEC, 2.0)


def test_scale_to_zero_allowed_by_the_minimum() -> None:
    spec = api.PrefillAutoscaling(minReplicas=0, maxReplicas=4)
    assert prefill_ask(PrefillSignals(0, 0, 10_000, 2), spec, 2.0) == 0


@pytest.mark.parametrize(
    ("asks", "now", "ask", "expected"),
    [
        ([], 100.0, 2, 2),
        ([(50.0, 5)], 100.0, 2, 5),  # a higher ask 50 s ago holds within a 300 s window
        ([(50.0, 5)], 400.0, 2, 2),  # past the window it no longer holds
        ([(90.0, 1)], 100.0, 3, 3),  # scale-up is at once
    ],
)
def test_scale_down_waits_for_the_window(asks, now, ask, expected) -> None:
    assert stabilised(asks, now, 300.0, ask) == expected


@pytest.mark.parametrize(
    ("decode", "prefill", "prefill_min", "expected"),
    [
        (0, 3, 1, (0, 0)),  # decode at zero: never a prefill replica alone
        (0, 0, 0, (0, 0)),
        (1, 0, 1, (1, 1)),  # decode woke from zero: prefill back to its minimum
        (4, 2, 1, (4, 2)),
        (2, 0, 0, (2, 0)),  # prefill may be zero beside decode (local prefill serves)
    ],
)
def test_the_pair_scales_to_zero_together(decode, prefill, prefill_min, expected) -> None:
    assert coordinate(decode, prefill, prefill_min) == expected


def _seen(now: float, waiting: float, tokens: float, **kw: float) -> PrefillObservation:
    fields = {"current": 1, "decode_replicas": 2, "ready": 1, "fresh": True, "running": 0.0,
              "requests": tokens / 1_000, **kw}  # fmt: skip
    return PrefillObservation(now=now, waiting=waiting, prompt_tokens=tokens, **fields)


BUSY = {"saturated": True, "ready": 1, "promptTokens": 0, "sampleTime": 0}


@pytest.mark.parametrize(
    ("before", "seen", "expected"),
    [
        # saturated at both ends, same replicas: 10,000 tokens in 2 s on one replica
        (BUSY, _seen(2, 3, 20_000), 10_000),
        # blended into what was learned (weight 0.5)
        ({"saturated": True, "ready": 1, "promptTokens": 0, "sampleTime": 0,
          "tokensPerSecond": 6_000}, _seen(2, 3, 20_000), 8_000),
        # not saturated now: an idle replica's rate is not its throughput
        ({"saturated": True, "ready": 1, "promptTokens": 0, "sampleTime": 0,
          "tokensPerSecond": 6_000}, _seen(2, 0, 2_000), 6_000),
        # the replica set changed, or a counter went back (a restart): keep the old figure
        ({**BUSY, "ready": 2}, _seen(2, 3, 20_000), None),
        ({"saturated": True, "ready": 1, "promptTokens": 50_000, "sampleTime": 0},
         _seen(2, 3, 20_000), None),
    ],
)  # fmt: skip
def test_throughput_is_learned_only_while_saturated(before, seen, expected) -> None:
    assert learn_throughput(seen, before) == expected


def test_decide_scales_on_work_holds_lower_asks_and_follows_decode_to_zero() -> None:
    learned = {"saturated": True, "ready": 1, "promptTokens": 0, "sampleTime": 0,
               "tokensPerSecond": 10_000}  # fmt: skip
    up = decide(_seen(5, 30, 50_000), learned, SPEC, ttft_seconds=2.0)
    assert (up.replicas, up.reason) == (3, "QueuedPrefillWork")  # 30 x 1,000 tokens: 3 s / 1 s
    later = decide(_seen(10, 0, 60_000, current=3), up.status, SPEC, ttft_seconds=2.0)
    assert (later.replicas, later.reason) == (3, "ScaleDownHeld")
    window = SPEC.scale_down_stabilization_seconds
    gone = decide(_seen(6 + window, 0, 60_000, current=3), later.status, SPEC, 2.0)
    assert gone.replicas == SPEC.min_replicas
    paired = decide(_seen(5, 30, 50_000, decode_replicas=0), learned, SPEC, 2.0)
    assert (paired.replicas, paired.reason) == (0, "PairAtZero")
    stale = decide(_seen(5, 0, 50_000, current=3, fresh=False), learned, SPEC, 2.0)
    assert stale.replicas == 3  # a failed scrape never lowers the count
