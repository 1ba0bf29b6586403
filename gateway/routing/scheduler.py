"""The scheduler: the wiring of one gateway process's routing state, and the wait loop.

Both front ends drive it the same way: `admit(target, routing, ...)` waits (bounded) until
the request can go somewhere and returns a `lifecycle.Ticket` that owns the rest of its
life (replicas best first, the fallback API with a slot held, or a 429/503 refusal). Where
it goes is the admission pass's answer (`dispatch.admit_once` with the gates of
`routing/gates/`, in order: adapters, flow when tenants are declared, slo); the ticket
tells the gates of its attempts (`dispatch.Hooks`) and reads the state wired here (load,
outliers, router, fallback slots). Nothing here reads a socket except the background work
`start` runs (discovery, scrapes, adapter loads through vLLM's runtime API, KV events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp
from kubellm.gateway.discovery.base import Discovery, ModelTarget
from kubellm.gateway.routing.admission import CompletionRate, FallbackSlots
from kubellm.gateway.routing.canary.revisions import revisions_failed
from kubellm.gateway.routing.dispatch import WAKE_IN, Decision, Hooks, Pass, admit_once
from kubellm.gateway.routing.flow.controller import Caller, Tenancy, bounded
from kubellm.gateway.routing.gates.adapters import AdapterGate
from kubellm.gateway.routing.gates.flow import FlowGate
from kubellm.gateway.routing.gates.slo import SloGate
from kubellm.gateway.routing.index.precise_routing import PreciseRouting
from kubellm.gateway.routing.latency import metrics as slo
from kubellm.gateway.routing.lifecycle import Ticket
from kubellm.gateway.routing.replicas import adapters, engine_api
from kubellm.gateway.routing.replicas.load import LoadView, scrape_loop
from kubellm.gateway.routing.replicas.outliers import OutlierDetector
from kubellm.gateway.routing.router import Router
from kubellm.gateway.routing.scorers.base import RoutingRequest
from kubellm.gateway.routing.settings import SchedulerSettings

__all__ = ["Scheduler", "SchedulerSettings"]


log = logging.getLogger("kubellm.gateway")


class Scheduler:
    """State shared by all requests of one process: load, health, prefix index, queues."""

    def __init__(
        self,
        discovery: Discovery,
        settings: SchedulerSettings | None = None,
        metrics: slo.GatewayMetrics | None = None,
    ) -> None:
        self.discovery = discovery
        self.settings = s = settings or SchedulerSettings()
        self.metrics = metrics or slo.create()
        self.load = LoadView(stale_after=s.stale_after)
        self.outliers = OutlierDetector(s.eject_after_failures, s.eject_base_seconds)
        self.precise = PreciseRouting(s.tokenizers, registry=self.metrics.registry)
        self.router = Router(
            self.load, self.outliers, precise=self.precise, registry=self.metrics.registry,
            presume_home=s.front_ends > 1,
        )  # fmt: skip
        self.predictions = self.router.predictions
        self.adapters = adapters.AdapterView(stale_after=s.stale_after)
        self.adapter_metrics = adapters.AdapterMetrics.create(self.metrics.registry)
        self.adapter_loads = adapters.AdapterLoads(
            self.adapters, self.adapter_metrics, limit=s.max_adapter_loads
        )
        if s.adapter_affinity:
            self.router.adapter_scorer = adapters.AdapterScorer(self.adapters, 1)
        self.load.scrape_hooks.append(self.adapters.record_scrape)
        self.fallback_in_flight = FallbackSlots(self.wake)  # the fallback API, per model
        self.queued: dict[str, int] = {}
        self.completions = CompletionRate()  # replica answers finished: predicts queue waits
        # what a waiting request waits on (made by the first to wait since the last wake:
        # a release no request waits for makes no event), and the wakes so far
        self._changed: asyncio.Event | None = None
        self._wakes = 0
        self.load.on_release(self.wake)
        self.tenancy = (
            Tenancy(bounded(s.tenancy, s.max_queue), self.metrics.registry) if s.tenancy else None
        )  # flow control bounds the queues with tenants (`tenancy.bounded`)
        # the pass's gates, in order (routing/dispatch.py); flow control only with tenants
        self.flow = FlowGate(
            self.tenancy, self.wake, self.load.prefill_rate,
            lambda url, ticket: self.router.cached_share(ticket.routing, url),
        )  # fmt: skip
        self.gates = (
            AdapterGate(self.adapters, self.adapter_loads, self.adapter_metrics, slo.labels),
            *((self.flow,) if self.tenancy is not None else ()),
            SloGate(self.predictions, slo.labels, lambda url: self.load.in_flight.get(url, 0)),
        )
        self.hooks = Hooks(self.gates)
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics.registry.register(slo.InFlightCollector(self.load.in_flight))

    def in_flight(self) -> dict[str, int]:
        """This front end's requests in flight per replica URL (those with any)."""
        return {url: n for url, n in list(self.load.in_flight.items()) if n > 0}

    # ---------------------------------------------------------------- lifecycle

    def start(self, client: aiohttp.ClientSession) -> None:
        """Start the background work (discovery, scraping every engine with `client`, the
        adapters' and the KV events' followers) in the running loop; `stop` ends it.

        Adapter loads and unloads go through the same `client` (vLLM's runtime adapter
        API, `engine_api`), so both front ends load an adapter no replica has."""
        loads = self.adapter_loads
        loads.loader = lambda url, name, path: engine_api.load_adapter(client, url, name, path)
        loads.unloader = lambda url, name, _path: engine_api.unload_adapter(client, url, name)
        self._tasks = [asyncio.create_task(c) for c in self.tasks(client)]
        self.update_ready_gauge()
        self.predictions.follow(self.discovery.snapshot().values())  # the first snapshot's priors

    async def stop(self) -> None:
        """End the background work started by `start` (the caller closes its client)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.tenancy is not None:
            await self.tenancy.close()

    def tasks(self, client: aiohttp.ClientSession) -> list[Coroutine[Any, Any, None]]:
        """The background work: discovery, and scraping every engine with `client`."""
        interval = self.settings.scrape_interval
        return [
            self.discovery.run(self.topology_changed),
            scrape_loop(client, self.engine_urls, self.load, interval),
            adapters.scrape_loop(
                client, lambda: adapters.lora_replicas(self.discovery.snapshot().values()),
                self.adapters, self.adapter_loads, interval,
            ),
            self.precise.run(self.discovery.snapshot),
        ]  # fmt: skip

    def engine_urls(self) -> list[str]:
        return [e.url for t in self.discovery.snapshot().values() for e in t.endpoints]

    def wake(self) -> None:
        """Capacity may have freed: let queued requests look again."""
        self._wakes += 1
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def topology_changed(self) -> None:
        """Endpoints appeared, left or were ejected."""
        self.wake()
        self.update_ready_gauge()
        self.predictions.follow(self.discovery.snapshot().values())  # priors; forgets the rest
        self.flow.forget(set(self.engine_urls()))

    def update_ready_gauge(self) -> None:
        """Each model's ready replicas, SLO and endpoint states on the gauges."""
        self.router.publish(self.discovery.snapshot().values(), self.metrics)

    # ---------------------------------------------------------------- admission

    async def admit(
        self,
        target: ModelTarget,
        routing: RoutingRequest,
        *,
        arrived: float | None = None,
        stream: bool = False,
        fallback: bool = True,
        caller: Caller | None = None,
    ) -> Ticket:
        """Wait (bounded by the TTFT target, or the scale-from-zero wait while the model
        has no replica) until the request can go somewhere (the pass, `dispatch.admit_once`),
        and return its ticket. `arrived`: when the request arrived (its TTFT starts there);
        `stream`: it asked for a stream; `fallback` False: this front end cannot reach
        the fallback API (the model is admitted as if it had none). A refused ticket is
        finished already and carries the error in `refusal`; a caller cancelled while
        waiting (its client left) gets its ticket finished as 499. `caller`: its tenant
        (`identify`), when tenants are declared: quotas, fallback rule, flow control."""
        start = time.monotonic()
        ticket = Ticket(self, target, routing, start if arrived is None else arrived, stream)
        ticket.caller = caller
        try:
            if caller is not None and self.tenancy is not None:
                refusal = await self.tenancy.admit(caller, routing.body)
                if refusal is not None:
                    ticket.fail(refusal)
                    return ticket
                fallback = fallback and caller.fallback_ok
            decision, target = await self._wait(target, routing, fallback, caller)
        except BaseException:
            ticket.finish()
            raise
        ticket._admitted(decision, target)
        return ticket

    async def _wait(
        self,
        target: ModelTarget,
        routing: RoutingRequest,
        fallback_allowed: bool,
        caller: Caller | None,
    ) -> tuple[Decision, ModelTarget]:
        """The wait loop: the pass again whenever capacity may have freed (or 0.5 s went
        by) until it decides; an adapter load it names is awaited (bounded) first."""
        model, s = target.served_name, self.settings
        start = time.monotonic()
        # every replica ejected and no fallback to take the request: try them anyway
        panic = not (fallback_allowed and target.fallback is not None)
        candidates = self.router.candidates(target, panic=panic)
        budget = target.slo.ttft_seconds if candidates else s.zero_replica_wait_seconds
        p = Pass(
            target, routing, start, start + budget, bool(candidates), s.thresholds, caller,
            self.completions.rate,
        )  # fmt: skip
        queued = False
        flowing = self.tenancy is not None and caller is not None  # flow control's queues
        try:
            for enter in self.hooks.enter:
                enter(p)
            while True:
                wakes = self._wakes
                if queued:  # re-read: endpoints may have appeared (scale from zero) or gone
                    target = self.discovery.snapshot().get(model, target)
                    candidates = self.router.candidates(target, panic=panic)
                waiting = self.queued.get(model, 0)
                p.refresh(
                    target, candidates, time.monotonic(),
                    target.fallback if fallback_allowed else None,
                    self.fallback_in_flight.get(model, 0),
                    waiting if queued else waiting + 1,
                    queued or flowing or waiting < s.max_queue,  # with tenants: flow's bound
                )  # fmt: skip
                decision = admit_once(p, self.gates, self.router)
                if decision is not None:
                    if p.dropped is None:
                        self.metrics.of(target).queue_wait.observe(p.now - start)
                    return decision, target
                if p.awaiting is not None:  # an adapter load, until the deadline
                    with contextlib.suppress(TimeoutError):
                        left = max(p.deadline - time.monotonic(), 0.001)
                        await asyncio.wait_for(asyncio.shield(p.awaiting), timeout=left)
                    p.waited = True
                    continue
                if not queued:
                    queued = True
                    self.queued[model] = self.queued.get(model, 0) + 1
                if self._wakes != wakes:  # woken during this pass: look again, after
                    await asyncio.sleep(0)  # the loop's other work, as after a wait
                    continue
                changed = self._changed
                if changed is None:
                    changed = self._changed = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    timeout = min(p.deadline - p.now, WAKE_IN, p.wake_in)
                    await asyncio.wait_for(changed.wait(), timeout=max(timeout, 0.001))
        finally:
            if queued:
                self.queued[model] -= 1
            for leave in self.hooks.leave:
                leave(p)

    # ---------------------------------------------------------------- outcomes

    def failed(self, url: str, fatal: bool = False) -> None:
        """A replica failed before its first byte. `fatal` (refused, frozen): eject now."""
        if self.outliers.failure(url, fatal=fatal):
            log.warning(
                "replica %s ejected for %.0f s after %s", url, self.outliers.ejected_for(url),
                "a fatal failure (refused, or no answer in time)" if fatal else "failures",
            )  # fmt: skip
            self.topology_changed()
        revisions_failed(self.metrics, self.discovery.snapshot().values(), url)  # canaries
