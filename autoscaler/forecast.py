"""A short-horizon forecast of the arrival rate: what the load will be once a replica is ready.

A replica asked for now serves `modelLoadSeconds` from now. A reactive rule asks
for the load of the last 30 s, so on growing load the replicas arrive one load
interval late, and the fallback (or a queue) carries the difference meanwhile.
`trend` asks for the load one load interval ahead, but only where the past
says the load *is* growing, not where it jumped once:

- the per-period arrival rates of the last `2 x horizon` seconds (from the
  gateway's admitted-request counter, status.autoscaler.gatewaySamples) are
  fitted with a straight line (least squares);
- growth is sustained when the slope exceeds `Z` standard errors of its
  Poisson noise (a period of `dt` seconds at rate `r` counts `r dt` requests,
  variance `r dt`), *and* the line explains the rates: the residuals' chi-square
  against that Poisson noise stays within three of its own standard deviations
  of what noise alone gives. A step or a burst is not a line: its residuals
  are far beyond noise, so no trend is seen, and the reactive signals act as
  before (a step cannot be told from the past; nor can a burst shorter than a
  model load be met by replicas asked after it began);
- the forecast is the line at `horizon` seconds past now.

It only ever raises the ask (a forecast of falling load is left to the
scale-down window, which waits for every recommendation to agree), so it adds
no direction change of its own: an ask it raised is remembered and held by
the window like any other. Pure: counts and times come in as numbers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

Z = 3.0  # standard errors the slope must exceed (at steady load: about once an hour)
MIN_FIT_SECONDS = 30.0  # the shortest history a trend is read from
MIN_POINTS = 6  # per-period rates the fit needs


def fit_seconds(horizon: float) -> float:
    """The history a forecast `horizon` seconds ahead reads: two horizons, at least 30 s."""
    return max(MIN_FIT_SECONDS, 2.0 * horizon)


def trend(
    samples: Sequence[tuple[float, float]], now: float, horizon: float, z: float = Z
) -> float | None:
    """The arrival rate `horizon` seconds from `now` where growth is sustained, else None.

    `samples`: (time, requests admitted so far) pairs, oldest first, as the gateway's
    counters were read every period; the fit reads those of the last
    `fit_seconds(horizon)` (fewer than `MIN_POINTS` periods, or under 80% of that span:
    no forecast).
    """
    if horizon <= 0:
        return None
    fit = fit_seconds(horizon)
    kept = sorted(s for s in samples if now - fit - 1e-6 <= s[0] <= now + 1e-6)
    points = []  # (midpoint, rate, seconds)
    for (t0, c0), (t1, c1) in itertools.pairwise(kept):
        if t1 <= t0 or c1 < c0:
            return None  # a counter that went back (a gateway restart): no history to read
        points.append(((t0 + t1) / 2, (c1 - c0) / (t1 - t0), t1 - t0))
    if len(points) < MIN_POINTS or kept[-1][0] - kept[0][0] < 0.8 * fit:
        return None
    total = sum(dt for _, _, dt in points)
    mean_rate = (kept[-1][1] - kept[0][1]) / total
    if mean_rate <= 0:
        return None
    # weighted least squares: a period of dt seconds has variance mean_rate / dt
    t_bar = sum(t * dt for t, _, dt in points) / total
    r_bar = mean_rate
    sxx = sum(dt * (t - t_bar) ** 2 for t, _, dt in points)
    if sxx <= 0:
        return None
    slope = sum(dt * (t - t_bar) * (r - r_bar) for t, r, dt in points) / sxx
    if slope <= z * math.sqrt(mean_rate / sxx):
        return None
    chi2 = sum(dt * (r - r_bar - slope * (t - t_bar)) ** 2 for t, r, dt in points) / mean_rate
    free = len(points) - 2
    if chi2 > free + 3.0 * math.sqrt(2.0 * free):
        return None  # not a line: a step or a burst
    return r_bar + slope * (now + horizon - t_bar)
