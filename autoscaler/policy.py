"""The scaling-policy interface, its data types, and a registry of policies.

A policy is a pure function of what was observed (`Observation`), what it
remembered from earlier decisions (`PolicyState`, persisted by the loop in
`status.autoscaler` so a restart forgets nothing) and the deployment's
`spec.autoscaling`. It returns a `Decision`: the replica count, a reason code
(for Events, status and the decisions-by-reason metric), a human message, and
the state to remember. No I/O, no clock: time arrives in `Observation.now`.

Policies register themselves by name (`register`); `get(name)` returns one.
The default, `kv-queue`, lives in `kubellm.autoscaler.kvqueue`.
"""

from __future__ import annotations

import datetime as dt
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubellm import api

DEFAULT_POLICY = "kv-queue"

# Reason codes (CamelCase, as Kubernetes Event reasons are).
QUEUE_DEPTH = "QueueDepth"
KV_CACHE_USAGE = "KVCacheUsage"
GATEWAY_PENDING = "GatewayPending"
MIN_REPLICAS = "MinReplicas"
MAX_REPLICAS = "MaxReplicas"
LOW_LOAD = "LowLoad"
IDLE = "Idle"
SCALE_UP_STABILIZING = "ScaleUpStabilizing"
SCALE_DOWN_STABILIZING = "ScaleDownStabilizing"
STALE_METRICS = "StaleMetrics"
REPLICAS_STARTING = "ReplicasStarting"
STEADY = "Steady"
CONCURRENCY = "Concurrency"
REQUEST_RATE = "RequestRate"
FALLBACK_ABSORBING = "FallbackAbsorbing"
FORECAST = "Forecast"  # spec.autoscaling.predictive: the load one model load ahead


@dataclass(frozen=True)
class ReplicaMetrics:
    """One ready engine replica's load, from its /metrics scrape.

    `fresh` is False when this period's scrape failed or lacked the metrics:
    the numbers are then unknown (and zero here), never trusted to scale down.
    """

    name: str
    fresh: bool
    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float = 0.0


@dataclass(frozen=True)
class Observation:
    """What the loop saw in one control period for one deployment.

    `replicas` holds the *ready* replicas only. Replicas counted in
    `current_replicas` (the value of /scale now) but not ready are starting:
    pulling an image or loading weights, capacity that is on its way.
    `gateway_pending` is None when the gateway's metrics could not be read.
    `request_rate` (requests/s arriving at the gateway over the last 30 s) and
    `recent_request_rate` (over the last period) are None when unknown: no
    gateway or too few scrapes yet. `fallback_share` is the share of admitted
    requests the gateway sent to the fallback over the scale-down window
    (None: the deployment has no fallback, or the gateway is unreadable);
    `replica_answer_rate` the requests/s the replicas answered over the last
    period (None: unknown); `refused` the requests the gateway answered itself
    (refused, or given up on while waiting) over the last period, with a fallback
    (None: no fallback, or unknown); `fallback_in_flight` the requests the fallback
    serves now (sent less answered, from the gateway's counters) and
    `fallback_capacity` the most it may serve at once (spec.fallback.maxConcurrency).
    `admitted_history`: (time, requests admitted so far) from the gateway's counters over
    the scale-down window, oldest first (empty: unknown); the forecast reads it
    (`kubellm.autoscaler.forecast`).
    """

    now: float
    current_replicas: int
    replicas: tuple[ReplicaMetrics, ...] = ()
    gateway_pending: float | None = None
    request_rate: float | None = None
    recent_request_rate: float | None = None
    fallback_share: float | None = None
    replica_answer_rate: float | None = None
    refused: float | None = None  # requests the gateway refused in the last period (fallback)
    fallback_in_flight: float | None = None  # requests at the fallback now (sent - answered)
    fallback_capacity: int | None = None  # spec.fallback.maxConcurrency
    admitted_history: tuple[tuple[float, float], ...] = ()  # (time, admitted so far)

    @property
    def fresh(self) -> tuple[ReplicaMetrics, ...]:
        return tuple(r for r in self.replicas if r.fresh)

    @property
    def stale(self) -> bool:
        """Some ready replica's load is unknown this period."""
        return any(not r.fresh for r in self.replicas)

    @property
    def starting(self) -> int:
        return max(0, self.current_replicas - len(self.replicas))


@dataclass(frozen=True)
class PolicyState:
    """What a policy remembers between periods (serialised into status.autoscaler).

    `recommendations`: (time, replicas) pairs inside the stabilisation
    windows, oldest first. `idle_since`: when the deployment was last seen
    becoming idle (no waiting, running or gateway-pending requests).
    `learned_rate`: requests/s one replica answered while every replica was
    saturated (a moving average), the derived per-replica rate where
    `targetRequestsPerReplica` is unset; `saturated_since`: since when every
    ready replica has been saturated (the learned rate waits out the first
    seconds, while answers still lag the load). `overflow_since`: since when
    the rate or KV signal has asked for more replicas than there are (the cost
    rule leaves an overflow to the fallback until it has lasted long enough).
    `peak_rate`: the most requests/s one replica has answered over a period (the
    replicas' answers over the fresh ready replicas, the largest seen), a lower bound of
    what a replica serves: the derived per-replica rate until one is learned.
    """

    recommendations: tuple[tuple[float, int], ...] = ()
    idle_since: float | None = None
    learned_rate: float | None = None
    saturated_since: float | None = None  # every replica saturated since (None: not now)
    overflow_since: float | None = None  # the signals asked above the fleet since (None: not)
    peak_rate: float | None = None  # the most one replica has answered per second

    def to_status(self) -> dict[str, Any]:
        """The camelCase fields this state adds to status.autoscaler."""
        return {
            "recommendations": [
                {"time": format_time(t), "replicas": r} for t, r in self.recommendations
            ],
            "idleSince": format_time(self.idle_since) if self.idle_since is not None else None,
            "learnedRequestsPerReplica": None
            if self.learned_rate is None
            else round(self.learned_rate, 4),
            "saturatedSince": None
            if self.saturated_since is None
            else format_time(self.saturated_since),
            "overflowSince": None
            if self.overflow_since is None
            else format_time(self.overflow_since),
            "peakRequestsPerReplica": None if self.peak_rate is None else round(self.peak_rate, 4),
        }

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> PolicyState:
        """Read the state back from status.autoscaler; tolerate absent or odd entries."""
        status = status or {}
        recommendations: list[tuple[float, int]] = []
        for entry in status.get("recommendations") or []:
            try:
                recommendations.append((parse_time(entry["time"]), int(entry["replicas"])))
            except (AttributeError, KeyError, TypeError, ValueError):
                continue
        idle = status.get("idleSince")
        try:
            idle_since = parse_time(idle) if idle else None
        except ValueError:
            idle_since = None
        learned_rate = _positive(status.get("learnedRequestsPerReplica"))
        saturated = status.get("saturatedSince")
        try:
            saturated_since = parse_time(saturated) if saturated else None
        except (TypeError, ValueError):
            saturated_since = None
        overflowing = status.get("overflowSince")
        try:
            overflow_since = parse_time(overflowing) if overflowing else None
        except (TypeError, ValueError, AttributeError):
            overflow_since = None
        return cls(
            tuple(sorted(recommendations)),
            idle_since,
            learned_rate,
            saturated_since,
            overflow_since,
            _positive(status.get("peakRequestsPerReplica")),
        )


def _positive(value: object) -> float | None:
    """A positive finite number read back from the status, else None."""
    try:
        number = float(value) if value is not None else None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if number is not None and 0 < number < float("inf") else None


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    message: str = ""
    state: PolicyState = field(default_factory=PolicyState)
    kv_cache_usage: float | None = None  # mean over fresh ready replicas
    queue_depth: float | None = None  # mean waiting requests per fresh ready replica


class Policy(Protocol):
    """One scaling policy. Implementations must be pure and deterministic."""

    def decide(
        self, observation: Observation, state: PolicyState, spec: api.Autoscaling
    ) -> Decision: ...


_REGISTRY: dict[str, Callable[[], Policy]] = {}
# Policies shipped with kubellm, imported on first lookup (one policy per module).
_BUILTIN_MODULES = ("kubellm.autoscaler.kvqueue", "kubellm.autoscaler.concurrency")


def register(name: str) -> Callable[[Callable[[], Policy]], Callable[[], Policy]]:
    """Class or factory decorator: make a policy available as `get(name)`."""

    def add(factory: Callable[[], Policy]) -> Callable[[], Policy]:
        _REGISTRY[name] = factory
        return factory

    return add


def unregister(name: str) -> None:
    """Remove a registered policy (a plugin being unloaded); unknown names are ignored."""
    _REGISTRY.pop(name, None)


def names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get(name: str = DEFAULT_POLICY) -> Policy:
    _load_builtins()
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(
            f"unknown autoscaling policy {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


def decide(observation: Observation, state: PolicyState, spec: api.Autoscaling) -> Decision:
    """Decide with the default policy."""
    return get(DEFAULT_POLICY).decide(observation, state, spec)


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def format_time(seconds: float) -> str:
    """Epoch seconds as RFC 3339 UTC with milliseconds (the form status fields use)."""
    stamp = dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def parse_time(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
