"""Outlier detection, after Envoy's: consecutive failures eject an endpoint for a while.

An endpoint that fails `threshold` times in a row (connection error or 5xx
before the first byte) is ejected for `base_seconds * 2^(n-1)` where n counts
its ejections, capped at `max_seconds`. One success resets the failure run;
the ejection count decays only when an endpoint serves successfully. A fatal failure
(connection refused, no first byte within its timeout) ejects at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Health:
    failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0


class OutlierDetector:
    def __init__(
        self,
        threshold: int = 3,
        base_seconds: float = 5.0,
        max_seconds: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.base_seconds = base_seconds
        self.max_seconds = max_seconds
        self.clock = clock
        self._health: dict[str, _Health] = {}

    def ejected(self, url: str) -> bool:
        health = self._health.get(url)
        return health is not None and self.clock() < health.ejected_until

    def ejected_for(self, url: str) -> float:
        """Seconds the endpoint's ejection has left (0 when not ejected)."""
        health = self._health.get(url)
        return 0.0 if health is None else max(0.0, health.ejected_until - self.clock())

    def success(self, url: str) -> None:
        health = self._health.get(url)
        if health is not None:
            health.failures = 0
            if not self.ejected(url):
                health.ejections = max(0, health.ejections - 1)

    def failure(self, url: str, fatal: bool = False) -> bool:
        """Record a failure; True when this one ejected the endpoint."""
        health = self._health.setdefault(url, _Health())
        health.failures += 1
        if health.failures < self.threshold and not fatal:
            return False
        health.failures = 0
        health.ejections += 1
        period = min(self.max_seconds, self.base_seconds * 2 ** (health.ejections - 1))
        health.ejected_until = self.clock() + period
        return True
