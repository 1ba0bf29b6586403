"""The control loop: observe, decide, write; once per period, for every target.

Each period (`Autoscaler.step`):
1. list the deployments with autoscaling enabled (`Backend.targets`), and those
   with LoRA adapters (`Backend.adapter_targets`);
2. scrape the gateway's /metrics once, for pending requests per model;
3. per deployment: find its engine endpoints, scrape the ready ones, build an
   `Observation`, restore the policy's state from status.autoscaler, and ask
   the policy for a `Decision`;
4. when the decision differs from /scale: write /scale and record an Event;
5. merge status.autoscaler (desired, reason, message, last scale time,
   inputs, and the policy state) when it changed; export metrics;
6. per deployment with spec.prefill.autoscaling: its prefill role after the decode role
   (`kubellm.autoscaler.prefill_loop`: queued prefill work against the TTFT budget,
   spec.prefill.replicas, status.autoscaler.prefill);
7. per deployment with adapters: read its ready replicas' /v1/models and
   `vllm:lora_requests_info` (the same scrape as step 3, once per period) and
   write status.adapters when it changed (`kubellm.autoscaler.adapters`).

All I/O goes through the `Backend` and one httpx client for scrapes; time
comes from an injected clock, so tests drive periods without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from kubellm.autoscaler import adapters, observe, overflow, prefill_loop, rate
from kubellm.autoscaler import policy as p
from kubellm.autoscaler.backend import AdapterTarget, Backend, Target
from kubellm.autoscaler.overflow import GatewayWindow
from kubellm.autoscaler.rate import RateWindow
from kubellm.autoscaler.telemetry import Telemetry

log = logging.getLogger(__name__)

DEFAULT_PERIOD = 5.0


@dataclass(frozen=True)
class Outcome:
    """What one period did for one target (returned for callers and tests)."""

    target: Target
    decision: p.Decision
    observation: p.Observation
    scaled: bool
    status: dict[str, Any]


class Autoscaler:
    def __init__(
        self,
        backend: Backend,
        http: httpx.AsyncClient,
        *,
        policy: p.Policy | None = None,
        gateway_metrics_url: str | None = None,
        clock: Callable[[], float] = time.time,
        telemetry: Telemetry | None = None,
        period: float = DEFAULT_PERIOD,
    ) -> None:
        self.backend = backend
        self.http = http
        self.policy = policy or p.get()
        self.gateway_metrics_url = gateway_metrics_url
        self.clock = clock
        self.telemetry = telemetry or Telemetry()
        self.period = period
        self._scrapes: dict[str, asyncio.Future[str | None]] = {}  # this period's /metrics

    def _scrape(self, url: str) -> asyncio.Future[str | None]:
        """One engine's /metrics text, scraped once per period whoever asks."""
        future = self._scrapes.get(url)
        if future is None:
            future = self._scrapes[url] = asyncio.ensure_future(observe.scrape(self.http, url))
        return future

    async def step(self) -> list[Outcome]:
        """One control period over every target. A failing target does not stop the others."""
        self._scrapes = {}
        try:
            targets = await self.backend.targets()
        except httpx.HTTPError as error:
            log.warning("cannot list deployments: %s", error)
            self.telemetry.errors.labels("list").inc()
            return []
        try:
            with_adapters = await self.backend.adapter_targets()
        except httpx.HTTPError as error:
            log.warning("cannot list deployments with adapters: %s", error)
            self.telemetry.errors.labels("list").inc()
            with_adapters = []
        gateway_text = None
        if self.gateway_metrics_url:
            gateway_text = await observe.scrape(self.http, self.gateway_metrics_url)
            if gateway_text is None:
                self.telemetry.errors.labels("gateway").inc()
        results = await asyncio.gather(
            *(self._one(target, gateway_text) for target in targets), return_exceptions=True
        )
        written = await asyncio.gather(
            *(self._adapters(target) for target in with_adapters), return_exceptions=True
        )
        for target, result in zip(with_adapters, written, strict=True):
            self._failed(target, result, "status.adapters of %s not written: %r", "adapters")
        outcomes = []
        for target, result in zip(targets, results, strict=True):
            failed = self._failed(target, result, "autoscaling %s failed: %r", "target")
            if not failed and result is not None:
                outcomes.append(result)
        return outcomes

    def _failed(
        self, target: Target | AdapterTarget, result: object, message: str, label: str
    ) -> bool:
        """Whether one target's gathered `result` is an error; an Exception is logged with
        `message` and counted under `label`, anything else raised (cancellation) goes up."""
        if not isinstance(result, BaseException):
            return False
        if not isinstance(result, Exception):
            raise result
        log.warning(message, target.key, result)
        self.telemetry.errors.labels(label).inc()
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Step every period until `stop` is set."""
        while not stop.is_set():
            started = self.clock()
            await self.step()
            remaining = max(0.0, self.period - (self.clock() - started))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=remaining)

    async def _one(self, target: Target, gateway_text: str | None) -> Outcome | None:
        """The decode role's period (when spec.autoscaling is on), then the prefill role's
        (spec.prefill.autoscaling), which follows the decode role's count."""
        outcome = await self._decode(target, gateway_text) if target.scales_decode else None
        if target.prefill is not None:
            decode = outcome.decision.replicas if outcome is not None else target.replicas
            await prefill_loop.tend(self.backend, self._scrape, target, decode, self.clock())
        return outcome

    async def _decode(self, target: Target, gateway_text: str | None) -> Outcome:
        endpoints = [e for e in await self.backend.endpoints(target) if e.ready]
        texts = await asyncio.gather(*(self._scrape(e.metrics_url) for e in endpoints))
        replicas = observe.fold_ranks(
            observe.replica_metrics(e.name, e.metrics_url, text)
            for e, text in zip(endpoints, texts, strict=True)
        )
        pending = _pending(gateway_text, target)
        now = self.clock()
        window, counted = _request_window(gateway_text, target, now)
        answers, answered = _gateway_window(gateway_text, target, now)
        observation = p.Observation(
            now=now,
            current_replicas=target.replicas,
            replicas=replicas,
            gateway_pending=pending,
            request_rate=window.rate if counted else None,
            recent_request_rate=window.recent if counted else None,
            fallback_share=answers.fallback_share if answered and target.has_fallback else None,
            replica_answer_rate=answers.replica_rate if answered else None,
            refused=answers.refused_recently if answered and target.has_fallback else None,
            fallback_in_flight=_fallback_in_flight(gateway_text, target),
            fallback_capacity=target.fallback_max_concurrency if target.has_fallback else None,
            admitted_history=tuple((t, a) for t, a, *_ in answers.samples) if answered else (),
        )
        state = p.PolicyState.from_status(target.status)
        decision = self.policy.decide(observation, state, target.autoscaling)

        scaled = decision.replicas != target.replicas
        if scaled:
            await self.backend.write_replicas(target, decision.replicas)
            log.info("%s: %s", target.key, decision.message)
            await self.backend.record_event(target, decision.reason, decision.message)
        status = {
            "desiredReplicas": decision.replicas,
            "reason": decision.reason,
            "message": decision.message,
            "lastScaleTime": p.format_time(now) if scaled else target.status.get("lastScaleTime"),
            "kvCacheUsage": _rounded(decision.kv_cache_usage),
            "queueDepth": _rounded(decision.queue_depth),
            "requestRate": _rounded(observation.request_rate),
            "requestSamples": window.to_status() or None,
            overflow.STATUS_KEY: answers.to_status() or None,
            "fallbackShare": _rounded(observation.fallback_share),
            **decision.state.to_status(),
        }
        if any(target.status.get(k) != v for k, v in status.items()):
            await self.backend.write_status(target, status)

        stale = sum(1 for r in replicas if not r.fresh)
        self.telemetry.record(target, decision, len(replicas), stale, pending, scaled)
        return Outcome(target, decision, observation, scaled, status)

    async def _adapters(self, target: AdapterTarget) -> list[dict[str, Any]] | None:
        """Write status.adapters of one deployment when it changed; returns it."""
        endpoints = [e for e in await self.backend.endpoints(target) if e.ready]
        texts = await asyncio.gather(*(self._scrape(e.metrics_url) for e in endpoints))
        answers = await asyncio.gather(*(adapters.models(self.http, e.url) for e in endpoints))
        replicas = [
            adapters.replica_adapters(answer, text, target.served_name)
            for answer, text in zip(answers, texts, strict=True)
        ]
        status = adapters.adapter_status(target.adapters, replicas)
        if status != target.status:
            await self.backend.write_adapters(target, status)
        return status


def _pending(gateway_text: str | None, target: Target) -> float | None:
    if gateway_text is None:
        return None
    try:
        return observe.gateway_pending(
            gateway_text, target.served_name, target.name, target.namespace
        )
    except observe.MetricsError as error:
        log.info("gateway metrics unusable: %s", error)
        return None


def _request_window(
    gateway_text: str | None, target: Target, now: float
) -> tuple[RateWindow, bool]:
    """The gateway's request counts in the rate window (`kubellm.autoscaler.rate.observe`).

    Counted with or without targetRequestsPerReplica: unset, the policy derives
    the per-replica rate and still needs the arrival rate.
    """
    admitted = None
    if gateway_text is not None:
        try:
            admitted = observe.gateway_admitted(
                gateway_text, target.served_name, target.name, target.namespace
            )
        except observe.MetricsError as error:
            log.info("gateway metrics unusable: %s", error)
    return rate.observe(target.status, now, admitted)


def _gateway_window(
    gateway_text: str | None, target: Target, now: float
) -> tuple[GatewayWindow, bool]:
    """The gateway's admitted, fallback and replica-answered counts over the scale-down
    window (`kubellm.autoscaler.overflow.observe`)."""
    counts = None
    if gateway_text is not None:
        names = (target.served_name, target.name, target.namespace)
        try:
            counts = (
                observe.gateway_admitted(gateway_text, *names),
                observe.gateway_fallback(gateway_text, *names),
                observe.gateway_answered(gateway_text, names[0], "replica", *names[1:]),
                observe.gateway_answered(gateway_text, names[0], "none", *names[1:]),
            )
        except observe.MetricsError as error:
            log.info("gateway metrics unusable: %s", error)
    window = target.autoscaling.scale_down_stabilization_seconds
    return overflow.observe(target.status, now, counts, window)


def _fallback_in_flight(gateway_text: str | None, target: Target) -> float | None:
    """Requests the fallback serves now: sent to it (counted when sent) less answered by it."""
    if gateway_text is None or not target.has_fallback:
        return None
    names = (target.served_name, target.name, target.namespace)
    try:
        sent = observe.gateway_fallback(gateway_text, *names)
        answered = observe.gateway_answered(gateway_text, names[0], "fallback", *names[1:])
    except observe.MetricsError:
        return None
    return max(0.0, sent - answered)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
