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
  is unset;
- the requests the gateway answered itself over the last period
  (`kubellm_gateway_requests_total{target="none"}`: refused with 429/503,
  or given up on while they waited): overflow the fallback did not absorb,
  which the cost rule (`spec.autoscaling.fallbackCostRatio`) never leaves
  to the fallback.

`GatewayWindow` keeps (time, admitted, fallback, replica-answered, refused) samples;
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

Sample = tuple[float, float, float, float, float]  # time, admitted, fallback, replica, refused


@dataclass(frozen=True)
class GatewayWindow:
    samples: tuple[Sample, ...] = ()  # oldest first

    def add(
        self,
        now: float,
        admitted: float,
        fallback: float,
        replica: float,
        window: float,
        refused: float = 0.0,
    ) -> GatewayWindow:
        """This period's sample; a counter that went down (gateway restart) starts afresh."""
        window = max(window, WINDOW_SECONDS)
        kept = [s for s in self.samples if now - window - 1e-6 <= s[0] < now]
        sample = (now, admitted, fallback, replica, refused)
        if kept and any(v < old for v, old in zip(sample[1:], kept[-1][1:], strict=True)):
            kept = []
        return GatewayWindow((*kept, sample))

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
        (t0, _, _, r0, _), (t1, _, _, r1, _) = self.samples[-2], self.samples[-1]
        return max(0.0, (r1 - r0) / (t1 - t0)) if t1 > t0 else None

    @property
    def refused_recently(self) -> float | None:
        """Requests the gateway answered itself (refused, or given up on) over the last
        period (None: one sample)."""
        if len(self.samples) < 2:
            return None
        return max(0.0, self.samples[-1][4] - self.samples[-2][4])

    def to_status(self) -> list[dict[str, Any]]:
        return [
            {"time": format_time(t), "admitted": a, "fallback": f, "replica": r, "refused": x}
            for t, a, f, r, x in self.samples
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
                        float(entry.get("refused", 0.0)),
                    )
                )
            except (AttributeError, KeyError, TypeError, ValueError):
                continue
        return cls(tuple(sorted(samples)))


def observe(
    status: Mapping[str, Any] | None,
    now: float,
    counts: tuple[float, ...] | None,
    window: float,
) -> tuple[GatewayWindow, bool]:
    """The window read back from status.autoscaler with this period's counts added.

    `counts` (admitted, fallback, replica-answered and, optionally, refused) is None when
    the gateway
    could not be read: no sample is added (the second value, whether the
    figures are current, is False) and older samples age out. The loop and
    the fleet simulation both call this.
    """
    found = GatewayWindow.from_status(status)
    if counts is None:
        keep = max(window, WINDOW_SECONDS)
        return GatewayWindow(tuple(s for s in found.samples if s[0] >= now - keep)), False
    admitted, fallback, replica, *refused = counts
    return found.add(now, admitted, fallback, replica, window, *refused), True
