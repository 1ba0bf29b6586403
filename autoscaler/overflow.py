"""What the gateway sent to the fallback, and what the replicas answered, from its counters.

Two figures come from successive scrapes of the gateway's counters
(`kubellm_gateway_requests_total` by `target` and the pending gauge: admitted
requests; `kubellm_gateway_fallback_requests_total`: sent to the fallback,
counted when sent; `kubellm_gateway_requests_total{target="replica"}`:
answered by replicas):

- the fallback's share of the requests admitted over the longer of the
  scale-down window and 30 s: sustained overflow is a reason to scale up,
  a short spike the fallback absorbs is not (`spec.autoscaling.maxFallbackShare`);
- the rate the replicas answered requests over the last period: while every
  replica is saturated, that rate per replica is what one replica serves,
  the per-replica rate the policy derives when `targetRequestsPerReplica`
  is unset.

`GatewayWindow` keeps (time, admitted, fallback, replica-answered) samples;
the loop persists them in `status.autoscaler.gatewaySamples` so a restart
forgets nothing. Pure: time and counts come in as numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubellm.autoscaler.policy import format_time, parse_time
from kubellm.autoscaler.rate import WINDOW_SECONDS

STATUS_KEY = "gatewaySamples"

Sample = tuple[float, float, float, float]  # time, admitted, fallback, replica-answered


@dataclass(frozen=True)
class GatewayWindow:
    samples: tuple[Sample, ...] = ()  # oldest first

    def add(
        self, now: float, admitted: float, fallback: float, replica: float, window: float
    ) -> GatewayWindow:
        """This period's sample; a counter that went down (gateway restart) starts afresh."""
        window = max(window, WINDOW_SECONDS)
        kept = [s for s in self.samples if now - window - 1e-6 <= s[0] < now]
        if kept and (admitted < kept[-1][1] or fallback < kept[-1][2] or replica < kept[-1][3]):
            kept = []
        return GatewayWindow((*kept, (now, admitted, fallback, replica)))

    @property
    def fallback_share(self) -> float | None:
        """Fallback answers over admitted requests across the window (None: one sample)."""
        if len(self.samples) < 2:
            return None
        first, last = self.samples[0], self.samples[-1]
        admitted = last[1] - first[1]
        if admitted <= 0:
            return 0.0
        return min(1.0, max(0.0, (last[2] - first[2]) / admitted))

    @property
    def replica_rate(self) -> float | None:
        """Requests/s the replicas answered over the last period (None: one sample)."""
        if len(self.samples) < 2:
            return None
        (t0, _, _, r0), (t1, _, _, r1) = self.samples[-2], self.samples[-1]
        return max(0.0, (r1 - r0) / (t1 - t0)) if t1 > t0 else None

    def to_status(self) -> list[dict[str, Any]]:
        return [
            {"time": format_time(t), "admitted": a, "fallback": f, "replica": r}
            for t, a, f, r in self.samples
        ]

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> GatewayWindow:
        """Read status.autoscaler.gatewaySamples back; odd entries are skipped."""
        samples = []
        for entry in (status or {}).get(STATUS_KEY) or []:
            try:
                samples.append(
                    (
                        parse_time(entry["time"]),
                        float(entry["admitted"]),
                        float(entry["fallback"]),
                        float(entry["replica"]),
                    )
                )
            except (AttributeError, KeyError, TypeError, ValueError):
                continue
        return cls(tuple(sorted(samples)))


def observe(
    status: Mapping[str, Any] | None,
    now: float,
    counts: tuple[float, float, float] | None,
    window: float,
) -> tuple[GatewayWindow, bool]:
    """The window read back from status.autoscaler with this period's counts added.

    `counts` (admitted, fallback, replica-answered) is None when the gateway
    could not be read: no sample is added (the second value, whether the
    figures are current, is False) and older samples age out. The loop and
    the fleet simulation both call this.
    """
    found = GatewayWindow.from_status(status)
    if counts is None:
        keep = max(window, WINDOW_SECONDS)
        return GatewayWindow(tuple(s for s in found.samples if s[0] >= now - keep)), False
    return found.add(now, *counts, window=window), True
