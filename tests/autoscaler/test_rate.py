"""The request rate from the gateway's counters: parsing, the window, its status round trip."""

from __future__ import annotations

import pytest
from kubellm.autoscaler import observe, rate
from kubellm.autoscaler.rate import RateWindow

from tests.autoscaler.conftest import gateway_text

T0 = 1_800_000_000.0


def test_admitted_is_answered_on_every_route_plus_pending() -> None:
    text = gateway_text({"tiny": 3, "other": 9}, {"tiny": 40, "other": 100})
    assert observe.gateway_admitted(text, "tiny", "tiny", "default") == 43
    assert observe.gateway_admitted(text, "tiny", "tiny", "elsewhere") == 0
    assert observe.gateway_admitted(gateway_text({}), "tiny") == 0  # nothing served yet


def test_admitted_rejects_text_that_is_not_prometheus() -> None:
    with pytest.raises(observe.MetricsError):
        observe.gateway_admitted("{not prometheus", "tiny")


def test_rate_over_the_window_and_over_the_last_period() -> None:
    window = RateWindow()
    for i, count in enumerate([0, 50, 100, 150, 200, 250, 300, 650]):
        window = window.add(T0 + 5 * i, count)
    # 30 s window: the first sample (t=0) has left it; seven samples remain
    assert [t - T0 for t, _ in window.samples] == [5, 10, 15, 20, 25, 30, 35]
    assert window.rate == pytest.approx((650 - 50) / 30)
    assert window.recent == pytest.approx(350 / 5)


def test_one_sample_gives_no_rate() -> None:
    window = RateWindow().add(T0, 10)
    assert (window.rate, window.recent) == (None, None)


def test_a_counter_reset_starts_afresh() -> None:
    window = RateWindow().add(T0, 500).add(T0 + 5, 550).add(T0 + 10, 20)
    assert window.samples == ((T0 + 10, 20),)
    assert window.rate is None


def test_status_round_trip_and_odd_entries() -> None:
    window = RateWindow().add(T0, 1).add(T0 + 5.5, 12)
    assert RateWindow.from_status({"requestSamples": window.to_status()}) == window
    odd = {"requestSamples": [{"time": "x", "count": 1}, {"count": 2}, {"time": None}]}
    assert RateWindow.from_status(odd) == RateWindow()
    assert RateWindow.from_status(None) == RateWindow()


def test_observe_adds_a_sample_or_marks_the_rate_unknown() -> None:
    status = {"requestSamples": RateWindow().add(T0, 0).add(T0 + 5, 35).to_status()}
    window, counted = rate.observe(status, T0 + 10, 70)
    assert counted and window.rate == pytest.approx(7) and len(window.samples) == 3
    window, counted = rate.observe(status, T0 + 33, None)  # the gateway could not be read
    assert not counted and window.samples == ((T0 + 5, 35),)  # no sample; t=0 aged out
