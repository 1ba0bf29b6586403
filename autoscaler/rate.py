"""The request rate the gateway sees for one model, from successive scrapes of its counters.

KV usage and queue depth read near zero until a replica is close to
saturation, so at low utilisation they cannot say how many replicas the load
needs; the request rate grows with load. The gateway counts a request in
`kubellm_gateway_pending_requests` when it admits it and moves it to
`kubellm_gateway_requests_total` when it answers, so their sum is the number
of requests admitted so far: its rate is the arrival rate, exact even while
requests queue (the answered rate alone lags and caps at what the fleet can
serve).

`RateWindow` keeps the (time, admitted) samples of the last `WINDOW_SECONDS`
(the loop persists them in status.autoscaler.requestSamples, so a restart
forgets nothing) and gives the rate over the window and over the last
period. Pure: time and counts come in as numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubellm.autoscaler.policy import format_time, parse_time

WINDOW_SECONDS = 30.0


@dataclass(frozen=True)
class RateWindow:
    samples: tuple[tuple[float, float], ...] = ()  # (time, admitted requests so far), oldest first

    def add(self, now: float, count: float, window: float = WINDOW_SECONDS) -> RateWindow:
        """This period's sample; a counter that went down (gateway restart) starts afresh."""
        kept = [(t, c) for t, c in self.samples if now - window - 1e-6 <= t < now]
        if kept and count < kept[-1][1]:
            kept = []
        return RateWindow((*kept, (now, count)))

    @property
    def rate(self) -> float | None:
        """Requests per second over the window; None until two samples span some time."""
        return _rate(self.samples[0], self.samples[-1]) if len(self.samples) > 1 else None

    @property
    def recent(self) -> float | None:
        """Requests per second over the last period (reacts to a step at once)."""
        return _rate(self.samples[-2], self.samples[-1]) if len(self.samples) > 1 else None

    def to_status(self) -> list[dict[str, Any]]:
        return [{"time": format_time(t), "count": c} for t, c in self.samples]

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> RateWindow:
        """Read status.autoscaler.requestSamples back; odd entries are skipped."""
        samples = []
        for entry in (status or {}).get("requestSamples") or []:
            try:
                samples.append((parse_time(entry["time"]), float(entry["count"])))
            except (AttributeError, KeyError, TypeError, ValueError):
                continue
        return cls(tuple(sorted(samples)))


def _rate(first: tuple[float, float], last: tuple[float, float]) -> float | None:
    span = last[0] - first[0]
    return max(0.0, (last[1] - first[1]) / span) if span > 0 else None


def observe(
    status: Mapping[str, Any] | None, now: float, admitted: float | None
) -> tuple[RateWindow, bool]:
    """The window read back from status.autoscaler with this period's count added.

    `admitted` is None when the gateway could not be read: no sample is added
    (the second value, whether the rate is current, is False) and older
    samples age out. The loop and the fleet simulation both call this.
    """
    window = RateWindow.from_status(status)
    if admitted is None:
        return RateWindow(tuple(s for s in window.samples if s[0] >= now - WINDOW_SECONDS)), False
    return window.add(now, admitted), True
