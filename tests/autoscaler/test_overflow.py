"""The fallback's share and the replicas' answer rate, from the gateway's counters."""

from __future__ import annotations

import pytest
from kubellm.autoscaler import observe, overflow
from kubellm.autoscaler.overflow import GatewayWindow

from kubellm import metrics

T0 = 1_800_000_000.0


def counters(admitted_replica: float, sent: float, pending: float = 0) -> str:
    labels = 'model="tiny",deployment="tiny",namespace="default"'
    return (
        f"# TYPE {metrics.GATEWAY_REQUESTS.removesuffix('_total')} counter\n"
        f'{metrics.GATEWAY_REQUESTS}{{{labels},target="replica",code="200"}} {admitted_replica}\n'
        f'{metrics.GATEWAY_REQUESTS}{{{labels},target="fallback",code="200"}} {sent}\n'
        f"# TYPE {metrics.GATEWAY_FALLBACK.removesuffix('_total')} counter\n"
        f'{metrics.GATEWAY_FALLBACK}{{{labels},reason="saturated"}} {sent * 0.75}\n'
        f'{metrics.GATEWAY_FALLBACK}{{{labels},reason="no-ready-replicas"}} {sent * 0.25}\n'
        f"# TYPE {metrics.GATEWAY_PENDING} gauge\n"
        f"{metrics.GATEWAY_PENDING}{{{labels}}} {pending}\n"
    )


def test_the_counters_the_window_reads() -> None:
    text = counters(90, 8, pending=2)
    assert observe.gateway_fallback(text, "tiny", "tiny", "default") == 8  # every reason
    assert observe.gateway_answered(text, "tiny", "replica", "tiny", "default") == 90
    assert observe.gateway_answered(text, "tiny", "fallback") == 8
    assert observe.gateway_fallback(text, "other") == 0


def test_share_over_the_window_and_the_replicas_answer_rate() -> None:
    window = GatewayWindow()
    # 20 admitted per 5 s; the fallback takes 10 in one period only, then nothing
    for i, (admitted, fallback, replica) in enumerate(
        [(0, 0, 0), (20, 0, 20), (40, 10, 30), (60, 10, 50), (80, 10, 70)]
    ):
        window = window.add(T0 + 5 * i, admitted, fallback, replica, window=300)
    assert window.fallback_share == pytest.approx(10 / 80)
    assert window.replica_rate == pytest.approx(20 / 5)
    # 300 s on, the period the fallback took its 10 has left the window
    later = window.add(T0 + 310, 180, 10, 170, window=300)
    assert later.samples[0][0] == T0 + 10 and later.fallback_share == 0.0


def test_a_short_window_still_spans_the_rate_window() -> None:
    window = GatewayWindow()
    for i in range(8):
        window = window.add(T0 + 5 * i, 10 * i, i, 9 * i, window=0)
    assert window.samples[0][0] == T0 + 5  # 30 s back, as the request-rate window


def test_a_gateway_restart_starts_afresh() -> None:
    window = GatewayWindow().add(T0, 100, 10, 90, 300).add(T0 + 5, 120, 12, 108, 300)
    restarted = window.add(T0 + 10, 5, 0, 5, 300)
    assert restarted.samples == ((T0 + 10, 5, 0, 5, 0.0),) and restarted.fallback_share is None


def test_status_round_trip_and_unreadable_gateway() -> None:
    window = GatewayWindow().add(T0, 100, 10, 90, 300).add(T0 + 5, 120, 12, 108, 300)
    status = {overflow.STATUS_KEY: [*window.to_status(), {"time": "bad"}, {"admitted": 1}]}
    again, counted = overflow.observe(status, T0 + 10, (130, 12, 118), 300)
    assert counted and len(again.samples) == 3
    assert again.fallback_share == pytest.approx(2 / 30)
    kept, counted = overflow.observe(status, T0 + 304, None, 300)
    assert not counted and [s[0] for s in kept.samples] == [T0 + 5]


def test_refusals_over_the_last_period_and_their_round_trip() -> None:
    window = GatewayWindow().add(T0, 100, 10, 90, 300, refused=3)
    assert window.refused_recently is None  # one sample
    window = window.add(T0 + 5, 120, 12, 100, 300, refused=7)
    assert window.refused_recently == 4
    again, counted = overflow.observe(
        {overflow.STATUS_KEY: window.to_status()}, T0 + 10, (130, 12, 110, 7), 300
    )
    assert counted and again.refused_recently == 0
    # a status written before the refused count existed reads as none refused
    old = [{k: v for k, v in e.items() if k != "refused"} for e in window.to_status()]
    assert GatewayWindow.from_status({overflow.STATUS_KEY: old}).refused_recently == 0
