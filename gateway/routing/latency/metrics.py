"""The gateway's Prometheus metrics, measured where the client feels latency.

Names come from `kubellm.metrics` (shared with the autoscaler, alerts and
dashboards); labels are model (served name), deployment and namespace. Each
deployment's SLO (targets and objective) is exported as gauges too, so the
recording rules compute per-deployment SLIs from the histogram bucket at the
target. Each gateway app has its own registry, so several can live in one process.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kubellm.gateway.routing.latency.histogram import Histogram
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.utils import floatToGoString

from kubellm import metrics

if TYPE_CHECKING:
    from kubellm.gateway.discovery.base import ModelTarget

# A chunk carrying generated text (engines send an empty role chunk before the first token).
TOKEN = re.compile(rb'"(?:content|text)":\s*"[^"]')

QUEUE_WAIT = metrics.GATEWAY_QUEUE_WAIT
PREFIX_MATCH = metrics.GATEWAY_PREFIX_MATCH

_LABELS = ("model", "deployment", "namespace")
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
_ITL = (0.001, 0.005, 0.01, 0.02, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 0.75, 1)
# The same buckets for the per-tenant series (tenancy.py), so the two compare.
LATENCY_BUCKETS, ITL_BUCKETS = _LATENCY, _ITL


def bucket_label(target: float, buckets: Sequence[float]) -> str:
    """The `le` label of the largest bucket bound at or under `target` (the SLI's "good"
    bucket), formatted exactly as prometheus-client formats bucket labels. A target
    under every bound takes the smallest bound."""
    at_or_under = [b for b in buckets if b <= target]
    return floatToGoString(max(at_or_under) if at_or_under else min(buckets))


def _name(full: str, suffix: str) -> str:
    """prometheus-client adds `_total` to counters itself."""
    return full.removesuffix(suffix)


def without_credentials(url: str) -> str:
    """`url` without any `user:password@` (a label on the metrics port must not carry it)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}"


def labels(target: ModelTarget) -> tuple[str, str, str]:
    """The metric labels of a model: served name, deployment, namespace."""
    return (target.served_name, target.deployment, target.namespace)


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry
    requests: Counter
    pending: Gauge
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    fallback: Counter
    goodput: Counter
    ready_endpoints: Gauge
    queue_wait: Histogram
    prefix_match: Histogram
    slo_target: Gauge
    slo_objective: Gauge
    fallback_tokens: Counter
    connections_refused: Counter
    config_reload_errors: Counter
    endpoint_info: Gauge
    # Per revision during a canary rollout (the operator's analysis reads these).
    revisions: RevisionMetrics | None = None

    _targets: dict[tuple[str, ...], TargetMetrics] = field(
        default_factory=dict, init=False, repr=False
    )
    # the last target object `of` looked up, and its series: a request looks its target up
    # three times (ticket, queue wait, prefix match). Keyed by identity (the object is held,
    # so its id is not reused); one tuple, so a reader sees a matching pair.
    _last: tuple[ModelTarget | None, TargetMetrics | None] = field(
        default=(None, None), init=False, repr=False
    )

    def target(self, labels: tuple[str, ...]) -> TargetMetrics:
        """One deployment's series, looked up once (`.labels()` costs on every request)."""
        found = self._targets.get(labels)
        if found is None:
            found = self._targets[labels] = TargetMetrics(self, labels)
        return found

    def of(self, target: ModelTarget) -> TargetMetrics:
        """`target(labels(target))`, without building the labels again for the same object."""
        last = self._last
        if last[0] is target:
            return last[1]  # type: ignore[return-value]
        found = self.target(labels(target))
        self._last = (target, found)
        return found

    def refused(self, status: int) -> None:
        """A request refused before it named a model (labels empty: no cardinality)."""
        self.requests.labels("", "", "", "none", str(status)).inc()

    def publish_endpoints(self, rows: Sequence[tuple[tuple[str, ...], str, str]]) -> None:
        """Replace the endpoint series with `rows` of (model labels, url, state)."""
        self.endpoint_info.clear()
        for names, url, state in rows:
            self.endpoint_info.labels(*names, without_credentials(url), state).set(1)

    def publish_slo(self, labels: Sequence[str], ttft: float, itl: float, objective: float) -> None:
        """Export one deployment's SLO as series the recording rules join on `le`."""
        self.slo_target.labels(*labels, "ttft", bucket_label(ttft, _LATENCY)).set(ttft)
        self.slo_target.labels(*labels, "itl", bucket_label(itl, _ITL)).set(itl)
        self.slo_objective.labels(*labels).set(objective)


class TargetMetrics:
    """The children of the per-deployment series, resolved once per label set.

    `requests` children (route, code) are cached on first use too. `pending` is a plain
    count the gauge reads when scraped (`set_function`): a request moves it twice, and a
    gauge child's `inc` and `dec` each cost what the rest of its record does.
    """

    __slots__ = (
        "_metrics", "_requests", "e2e", "goodput", "itl", "labels", "pending",
        "prefix_match", "queue_wait", "ttft",
    )  # fmt: skip

    def __init__(self, metrics: GatewayMetrics, labels: tuple[str, ...]) -> None:
        self._metrics = metrics
        self.labels = labels
        self.pending = 0  # requests admitted and not yet answered (`RequestRecord`)
        metrics.pending.labels(*labels).set_function(lambda: self.pending)
        self.ttft: Any = metrics.ttft.labels(*labels)
        self.itl: Any = metrics.itl.labels(*labels)
        self.e2e: Any = metrics.e2e.labels(*labels)
        self.goodput: Any = metrics.goodput.labels(*labels)
        self.queue_wait: Any = metrics.queue_wait.labels(*labels)
        self.prefix_match: Any = metrics.prefix_match.labels(*labels)
        self._requests: dict[tuple[str, int], Any] = {}

    def requests(self, route: str, code: int) -> Any:
        child = self._requests.get((route, code))
        if child is None:
            child = self._requests[route, code] = self._metrics.requests.labels(
                *self.labels, route, str(code)
            )
        return child


STABLE_REVISION = "stable"  # the revision label of endpoints without one (the stable side)
# The per-class analysis histograms: 1.5x apart, fine enough for a 1.5x ratio test.
CLASS_TTFT_BUCKETS = tuple(round(0.005 * 1.5**i, 6) for i in range(24))  # 5 ms .. 56 s
CLASS_TPOT_BUCKETS = tuple(round(0.001 * 1.5**i, 6) for i in range(20))  # 1 ms .. 2.2 s
CLIENT_CAP = 5  # answers of one client per revision and step counted in the latency figures
LEDGER_CLIENTS = 50_000  # clients remembered per revision and step; beyond, one shared key
LEDGER_STEPS = 8  # (model, revision, weight) steps remembered


class Ledger:
    """Per (model, revision, step weight): how many answers of each client were counted.
    Bounded: LEDGER_STEPS steps (oldest forgotten), LEDGER_CLIENTS clients each (the rest
    share one key, so a flood of fresh keys cannot grow it)."""

    def __init__(self) -> None:
        self.steps: dict[tuple, dict[str, int]] = {}

    def count(self, step: tuple, client: str) -> tuple[bool, bool]:
        """One answer of `client` in `step`: (first of this client, counted in latency)."""
        seen = self.steps.get(step)
        if seen is None:
            while len(self.steps) >= LEDGER_STEPS:
                del self.steps[next(iter(self.steps))]
            seen = self.steps[step] = {}
        if client not in seen and len(seen) >= LEDGER_CLIENTS:
            client = "overflow"
        n = seen.get(client, 0)
        seen[client] = n + 1
        return n == 0, n < CLIENT_CAP


class RevisionMetrics:
    """One model's figures per revision while a canary rollout splits its traffic: answers
    by outcome, SLO-meeting answers, TTFT and ITL (routing/canary/revisions.py chooses the side;
    the operator's canary analysis compares the canary's figures with the rest)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        names = [*_LABELS, "revision"]
        self.requests = Counter(
            _name(metrics.GATEWAY_REVISION_REQUESTS, "_total"),
            "Requests a replica of the revision answered, by outcome (ok|error: 5xx or a "
            "broken stream).",
            [*names, "outcome"],
            registry=registry,
        )
        self.slo_met = Counter(
            _name(metrics.GATEWAY_REVISION_SLO_MET, "_total"),
            "Streamed answers of the revision that met both the TTFT and the ITL target.",
            names,
            registry=registry,
        )
        self.ttft = Histogram(
            metrics.GATEWAY_REVISION_TTFT, "Time to first token, per revision.", names,
            buckets=_LATENCY, registry=registry,
        )  # fmt: skip
        self.itl = Histogram(
            metrics.GATEWAY_REVISION_ITL, "Time between streamed chunks, per revision.", names,
            buckets=_ITL, registry=registry,
        )  # fmt: skip
        # The canary analysis' figures: per prompt-size class, one client's answers counted
        # at most CLIENT_CAP times per step (routing/canary/revisions.py, operator/rollout.py).
        classed = [*names, "class"]
        self.class_requests = Counter(
            _name(metrics.GATEWAY_REVISION_CLASS_REQUESTS, "_total"),
            "Answers of the revision per prompt-size class (streamed or not).",
            classed, registry=registry,
        )  # fmt: skip
        self.clients = Counter(
            _name(metrics.GATEWAY_REVISION_CLIENTS, "_total"),
            "Distinct clients (tenants, else sessions or prompts) the revision answered in "
            "each canary step.",
            names, registry=registry,
        )  # fmt: skip
        self.stream_ttft = Histogram(
            metrics.GATEWAY_REVISION_STREAM_TTFT,
            "Streamed answers' time to first token, per revision and prompt-size class "
            "(at most CLIENT_CAP answers of one client per step).",
            classed, buckets=CLASS_TTFT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.tpot = Histogram(
            metrics.GATEWAY_REVISION_TPOT,
            "Streamed answers' mean time per output token after the first, per revision and "
            "prompt-size class (at most CLIENT_CAP answers of one client per step).",
            classed, buckets=CLASS_TPOT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.ledger = Ledger()


def create(registry: CollectorRegistry | None = None) -> GatewayMetrics:
    r = registry or CollectorRegistry()
    return GatewayMetrics(
        revisions=RevisionMetrics(r),
        registry=r,
        requests=Counter(
            _name(metrics.GATEWAY_REQUESTS, "_total"),
            "Requests answered, by route (replica|fallback|none) and HTTP status.",
            [*_LABELS, "target", "code"],
            registry=r,
        ),
        pending=Gauge(
            metrics.GATEWAY_PENDING,
            "Requests admitted and not yet answered (queued or in flight).",
            _LABELS,
            registry=r,
        ),
        ttft=Histogram(
            metrics.GATEWAY_TTFT,
            "Time to first token at the gateway (queue wait included).",
            _LABELS,
            buckets=_LATENCY,
            registry=r,
        ),
        itl=Histogram(
            metrics.GATEWAY_ITL,
            "Time between streamed chunks at the gateway.",
            _LABELS,
            buckets=_ITL,
            registry=r,
        ),
        e2e=Histogram(
            metrics.GATEWAY_E2E,
            "End-to-end request duration at the gateway.",
            _LABELS,
            buckets=_LATENCY,
            registry=r,
        ),
        fallback=Counter(
            _name(metrics.GATEWAY_FALLBACK, "_total"),
            "Requests sent to the fallback API, by reason.",
            [*_LABELS, "reason"],
            registry=r,
        ),
        goodput=Counter(
            _name(metrics.GATEWAY_GOODPUT, "_total"),
            "Successful requests that met both the TTFT and the ITL target.",
            _LABELS,
            registry=r,
        ),
        ready_endpoints=Gauge(
            metrics.GATEWAY_READY_ENDPOINTS,
            "Endpoints that may take new requests.",
            _LABELS,
            registry=r,
        ),
        queue_wait=Histogram(
            QUEUE_WAIT,
            "Time requests waited in the gateway's admission queue.",
            _LABELS,
            buckets=_LATENCY,
            registry=r,
        ),
        prefix_match=Histogram(
            PREFIX_MATCH,
            "Share of the prompt's prefix chain already sent to the chosen replica.",
            _LABELS,
            buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        ),
        slo_target=Gauge(
            metrics.GATEWAY_SLO_TARGET,
            "The deployment's TTFT or ITL target (kind); le names the histogram bucket at it.",
            [*_LABELS, "kind", "le"],
            registry=r,
        ),
        slo_objective=Gauge(
            metrics.GATEWAY_SLO_OBJECTIVE,
            "The deployment's SLO objective: the share of requests that must meet the targets.",
            _LABELS,
            registry=r,
        ),
        fallback_tokens=Counter(
            _name(metrics.GATEWAY_FALLBACK_TOKENS, "_total"),
            "Tokens the fallback API reported in usage (kind=prompt|completion), for cost.",
            [*_LABELS, "kind"],
            registry=r,
        ),
        connections_refused=Counter(
            _name(metrics.GATEWAY_CONNECTIONS_REFUSED, "_total"),
            "Client connections answered 503 and closed at once: the connection cap was reached.",
            registry=r,
        ),
        endpoint_info=Gauge(
            metrics.GATEWAY_ENDPOINT_INFO,
            "Each engine endpoint the gateway knows, by state (ready, draining, ejected, down).",
            [*_LABELS, "url", "state"],
            registry=r,
        ),
        config_reload_errors=Counter(
            _name(metrics.GATEWAY_CONFIG_RELOAD_ERRORS, "_total"),
            "Reloads of the static configuration file that failed (the last good one is kept).",
            registry=r,
        ),
    )


@dataclass(slots=True)
class StreamTiming:
    """When a streamed answer's chunks carrying text arrived: TTFT and the gaps (ITL).
    (Slots: every request builds one.)"""

    start: float
    first: float | None = None
    last: float | None = None
    chunks: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None

    def token(self, now: float) -> None:
        """A chunk carrying generated text arrived at `now`."""
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now
        self.chunks += 1

    def failed(self, error: BaseException | str) -> None:
        """The upstream broke mid-stream."""
        name = error if isinstance(error, str) else type(error).__name__
        self.error = f"upstream stream failed: {name}"

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def mean_itl(self) -> float | None:
        if self.first is None or self.last is None or self.chunks < 2:
            return None
        return (self.last - self.first) / (self.chunks - 1)


class RequestRecord:
    """One request's accounting in a deployment's series: pending while it lives, then
    its outcome (route, status) and end-to-end time counted exactly once."""

    __slots__ = ("arrived", "finished", "revision", "sample", "series")

    def __init__(self, series: TargetMetrics, arrived: float) -> None:
        self.series = series
        self.arrived = arrived
        self.finished = False
        # During a canary rollout: the revision of the replica that answers (set once the
        # replica is known: Scheduler.routed's caller), counted in the per-revision series.
        self.revision: str | None = None
        # and its (step, client, prompt-size class) for the analysis' figures
        self.sample: tuple[tuple, str, str] | None = None
        series.pending += 1

    def finish(self, route: str, code: int) -> None:
        if self.finished:
            return
        self.finished = True
        series = self.series
        series.pending -= 1
        series.requests(route, code).inc()
        series.e2e.observe(time.monotonic() - self.arrived)
        per_revision = series._metrics.revisions
        if self.revision is not None and route == "replica" and per_revision is not None:
            outcome = "error" if code >= 500 else "ok"
            per_revision.requests.labels(*series.labels, self.revision, outcome).inc()

    def revision_observed(
        self, ttft: float | None, gaps: Sequence[float], met: bool, streamed: bool = True
    ) -> None:
        """An answer's TTFT, ITL gaps and SLO outcome in its revision's series, while a
        canary rollout splits the model (nothing otherwise)."""
        series = self.series
        per_revision = series._metrics.revisions
        if self.revision is None or per_revision is None:
            return
        names = (*series.labels, self.revision)
        if ttft is not None:
            per_revision.ttft.labels(*names).observe(ttft)
        per_revision.itl.labels(*names).observe_all(gaps)
        if met:
            per_revision.slo_met.labels(*names).inc()
        if self.sample is not None:
            step, client, size = self.sample
            first, counted = per_revision.ledger.count(step, client)
            per_revision.class_requests.labels(*names, size).inc()
            if first:
                per_revision.clients.labels(*names).inc()
            if counted and streamed and ttft is not None:  # like with like: streamed TTFT
                per_revision.stream_ttft.labels(*names, size).observe(ttft)
                if gaps:
                    per_revision.tpot.labels(*names, size).observe(sum(gaps) / len(gaps))


class InFlightCollector:
    """`kubellm_gateway_endpoint_in_flight{url}`, read from a front end's in-flight counts
    (url -> requests) when scraped."""

    def __init__(self, in_flight: dict[str, int]) -> None:
        self.in_flight = in_flight

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            metrics.GATEWAY_ENDPOINT_IN_FLIGHT,
            "This front end's requests in flight on each engine endpoint (slots held).",
            labels=["url"],
        )
        for url, count in sorted(list(self.in_flight.items())):
            if count > 0:
                family.add_metric([without_credentials(url)], count)
        return [family]
