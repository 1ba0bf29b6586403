"""The scheduler: what one gateway process knows about its fleet, and where each request goes.

Both front ends drive it the same way: `admit(target, routing, ...)` waits (bounded)
until the request can go somewhere and returns a `lifecycle.Ticket` that owns the rest of
the request's life (a replica route with the candidates best first, the fallback API with
its concurrency slot held, or a refusal: 429 when saturated, 503 when no replica exists).
The ticket calls back into the scheduler (`acquire`, `failed`, `succeeded`, `routed`,
`completed`, `fallback_slot`); front ends do not.

The HTTP front end (`kubellm.gateway.http`) sends the bytes itself; the endpoint picker
(`kubellm.gateway.epp`) answers with the chosen endpoints and lets Envoy send them.
Nothing here reads a socket except the scrape loop and discovery, started by `tasks`, and
the adapter loads (`engine_api`, vLLM's runtime adapter API) that `start` wires up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import aiohttp
from kubellm.gateway.discovery.base import Discovery, Endpoint, ModelTarget
from kubellm.gateway.routing import adapters, engine_api, slo
from kubellm.gateway.routing import flow as flows
from kubellm.gateway.routing.admission import (
    CompletionRate,
    Decision,
    Route,
    decide,
    predicted_wait,
    saturated,
)
from kubellm.gateway.routing.latency import Dispatch
from kubellm.gateway.routing.lifecycle import Attempt, Ticket, labels
from kubellm.gateway.routing.load import LoadView, scrape_loop
from kubellm.gateway.routing.outliers import OutlierDetector
from kubellm.gateway.routing.precise import PreciseRouting
from kubellm.gateway.routing.revisions import revisions_failed
from kubellm.gateway.routing.router import Router
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.settings import SchedulerSettings
from kubellm.gateway.routing.tenancy import Caller, Tenancy, bounded

__all__ = ["Scheduler", "SchedulerSettings", "labels"]

from prometheus_client.core import GaugeMetricFamily

from kubellm.metrics import GATEWAY_ENDPOINT_IN_FLIGHT, parse_lora_info

# How often (answers) the replicas' speed factors are recomputed for /metrics.
SPEED_EVERY = 16


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
        self._answers = 0
        self.adapters = adapters.AdapterView(stale_after=s.stale_after)
        self.adapter_metrics = adapters.AdapterMetrics.create(self.metrics.registry)
        self.adapter_loads = adapters.AdapterLoads(
            self.adapters, self.adapter_metrics, limit=s.max_adapter_loads
        )
        if s.adapter_affinity:
            self.router.adapter_scorer = adapters.AdapterScorer(self.adapters, 1)
        self.load.scrape_hooks.append(
            lambda url, text: self.adapters.record_info(url, parse_lora_info(text))
        )
        self.fallback_in_flight: dict[str, int] = {}
        self.queued: dict[str, int] = {}
        self.completions = CompletionRate()  # replica answers finished: predicts queue waits
        self._changed = asyncio.Event()
        self.load.on_release(self.wake)
        self.tenancy = (
            Tenancy(bounded(s.tenancy, s.max_queue), self.metrics.registry) if s.tenancy else None
        )  # flow control bounds the queues with tenants (`tenancy.bounded`)
        # replica -> high-band streams sent there still awaiting their first token (flow.py,
        # `hold_prefill`): low bands do not dispatch there meanwhile
        self.prefilling: dict[str, int] = {}
        # replica -> (low-band prompt tokens owed, when) under `headroom_prefill_rate`
        self.low_prefill: dict[str, tuple[float, float]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics.registry.register(_InFlightCollector(self.load))

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
        return [
            self.discovery.run(self.topology_changed),
            scrape_loop(client, self.engine_urls, self.load, self.settings.scrape_interval),
            adapters.scrape_loop(
                client,
                self.lora_replicas,
                self.adapters,
                self.adapter_loads,
                self.settings.scrape_interval,
            ),
            self.precise.run(self.discovery.snapshot),
        ]

    def lora_replicas(self) -> dict[str, tuple[str, frozenset[str]]]:
        """Replicas of models with adapters: url -> (served name, the adapters wanted)."""
        return {
            e.url: (t.served_name, frozenset(a.name for a in t.adapters))
            for t in self.discovery.snapshot().values()
            if t.adapters
            for e in t.endpoints
        }

    def engine_urls(self) -> list[str]:
        return [e.url for t in self.discovery.snapshot().values() for e in t.endpoints]

    def wake(self) -> None:
        """Capacity may have freed: let queued requests look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    def topology_changed(self) -> None:
        """Endpoints appeared, left or were ejected."""
        self.wake()
        self.update_ready_gauge()
        urls = self.engine_urls()
        self.predictions.follow(self.discovery.snapshot().values())  # priors; forgets the rest
        self.low_prefill = {u: owed for u, owed in self.low_prefill.items() if u in urls}

    def update_ready_gauge(self) -> None:
        rows = []
        for target in self.discovery.snapshot().values():
            names = labels(target)
            ready = len(self.router.candidates(target))
            self.metrics.ready_endpoints.labels(*names).set(ready)
            s = target.slo
            self.metrics.publish_slo(names, s.ttft_seconds, s.itl_seconds, s.objective)
            rows += [(names, e.url, self.endpoint_state(e)) for e in target.endpoints]
        self.metrics.publish_endpoints(rows)

    def endpoint_state(self, endpoint: Endpoint) -> str:
        """ready, draining, ejected (failures) or down (its latest scrape failed)."""
        if endpoint.draining:
            return "draining"
        if self.outliers.ejected(endpoint.url):
            return "ejected"
        return "down" if self.load.down(endpoint.url) else "ready"

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
        has no replica) until the request can go somewhere (see `admission.decide`), and
        return its ticket. `arrived`: when the request arrived (its TTFT starts there);
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
            route, reason, order, target, loading = await self._decide(
                target, routing, fallback, caller
            )
        except BaseException:
            ticket.finish()
            raise
        ticket._admitted(route, reason, order, target, loading)
        if caller is not None and self.tenancy is not None and route is Route.REJECT:
            self.tenancy.dropped(caller, reason, ticket.refusal)
        return ticket

    def identify(self, headers: Mapping[str, str]) -> Caller | None:
        """The tenant of a request from its headers, names in lower case (None: no tenants
        declared); raises the 401 or 400 to answer (`tenancy.Tenancy.identify`)."""
        if self.tenancy is None:
            return None
        return self.tenancy.identify(headers)

    def ended(self, ticket: Ticket) -> None:
        """A ticket finished: its tenant's usage and counters (the ticket calls this)."""
        if ticket.caller is not None and self.tenancy is not None:
            holding = ticket.caller.holding
            self.tenancy.ended(ticket, ticket.caller)
            if holding is not None and self.tenancy.settings.flow.fair_in_flight_tokens:
                self.wake()  # a tenant held at its fair in-flight share may go now

    async def _decide(
        self,
        target: ModelTarget,
        routing: RoutingRequest,
        fallback_allowed: bool,
        caller: Caller | None = None,
    ) -> tuple[Route, str, list[Candidate], ModelTarget, str | None]:
        model = target.served_name
        start = time.monotonic()
        candidates = self.router.candidates(target)
        ready_now = bool(candidates)
        budget = target.slo.ttft_seconds if ready_now else self.settings.zero_replica_wait_seconds
        tenancy = self.tenancy if caller is not None else None
        if tenancy is not None:  # flow control: queues per band x tenant (flow.py)
            assert caller is not None
            flow_settings = tenancy.settings.flow
            flow = tenancy.flow(model)
            waiter = tenancy.waiter(caller)
            shed = flow.join(waiter)
            if shed:
                self.wake()  # shed waiters look again, and go
            if waiter.dropped:
                return Route.REJECT, waiter.dropped, [], target, None
            ttl = flow_settings.ttl_seconds  # sheddable: may wait its band's TTL
            budget = ttl if caller.priority < 0 else min(budget, ttl)
        deadline = start + budget
        queued = False
        loaded = False  # an adapter was loaded for this request
        try:
            while True:
                changed = self._changed
                wake_in = 0.5
                if queued:  # re-read: endpoints may have appeared (scale from zero) or gone
                    target = self.discovery.snapshot().get(model, target)
                    candidates = self.router.candidates(target)
                if routing.adapter is not None and candidates:
                    candidates, loading = await self.adapter_holders(
                        target, routing.adapter, candidates, deadline
                    )
                    loaded = loaded or loading
                    loads = self.adapter_loads
                    if not candidates and (
                        loads.loader is None or (loading and loads.failed(routing.adapter))
                    ):  # no replica has it and none will load it now (it failed, or this
                        deadline = time.monotonic()  # front end cannot load): no waiting
                thresholds = self.settings.thresholds
                open_ = [c for c in candidates if not saturated(c, thresholds)]
                now = time.monotonic()
                fallback = target.fallback if fallback_allowed else None
                if tenancy is not None:
                    if waiter.dropped:  # shed while waiting
                        return Route.REJECT, waiter.dropped, [], target, None
                    capped = frozenset[tuple[int, str]]()
                    if flow_settings.fair_in_flight_tokens:  # fair in-flight budget
                        capacity = flow_settings.fair_in_flight_tokens * len(candidates)
                        capped = flow.held(capacity)
                    if flow.head(held=capped) is not waiter:  # not its turn for a replica:
                        open_ = []  # wait, and the fallback only when next in line for it
                        if flow.head(fallback=True, held=capped) is not waiter:
                            fallback = None
                    elif waiter.band < flow_settings.headroom_below:
                        held = self.prefilling
                        flow.learn(candidates)
                        below = [
                            c
                            for c in open_
                            if flows.below_line(
                                c,
                                flow_settings,
                                held.get(c.url, 0),
                                self.debt(c.url, now),
                                flow.slots.get(c.url),
                            )
                        ]
                        if open_ and not below:  # room kept for high bands: wait for it,
                            fallback = None  # the paid API is not for sheddable overflow
                            wake_in = self.drain_in(open_, now)  # or for a debt to drain
                        open_ = below
                waiting = self.queued.get(model, 0)
                room = queued or tenancy is not None or waiting < self.settings.max_queue
                position = waiting if queued else waiting + 1
                rate = 0.0 if open_ else self.completions.rate(c.url for c in candidates)
                predicted = None
                if target.routing.policy == "slo-aware" and open_:
                    predicted = self.best_ttft(target, routing, open_)
                decision = decide(
                    ready=len(candidates),
                    unsaturated=len(open_),
                    fallback=fallback,
                    fallback_in_flight=self.fallback_in_flight.get(model, 0),
                    may_wait=room and now < deadline,
                    wait=predicted_wait(position, rate),
                    budget_left=deadline - now if ready_now else 0.0,
                    predicted_ttft=predicted,
                )
                if decision.route is not Route.QUEUE:
                    order = self.router.order(target, routing, open_) if open_ else []
                    if order:  # the saturated ones last: alive, so better than no answer
                        chosen = {c.url for c in order}
                        order += [c for c in candidates if c.url not in chosen]
                    waited = now - start
                    self.metrics.target(labels(target)).queue_wait.observe(waited)
                    pending = None
                    if tenancy is not None:
                        assert caller is not None
                        if decision == Decision(Route.REJECT, "saturated") and now >= deadline:
                            decision = Decision(Route.REJECT, "ttl")
                        is_replica = decision.route is Route.REPLICA
                        tenancy.dispatched(model, caller, waited, is_replica)
                    if routing.adapter is not None:
                        self.adapter_placed(target, routing.adapter, decision.route, order, loaded)
                        if decision.route is Route.REJECT and self.adapter_loads.pending(
                            routing.adapter
                        ):
                            pending = routing.adapter
                    return decision.route, decision.reason, order, target, pending
                if not queued:
                    queued = True
                    self.queued[model] = self.queued.get(model, 0) + 1
                with contextlib.suppress(TimeoutError):
                    timeout = min(deadline - now, 0.5, wake_in)
                    await asyncio.wait_for(changed.wait(), timeout=max(timeout, 0.001))
        finally:
            if queued:
                self.queued[model] -= 1
            if tenancy is not None:
                flow.leave(waiter)
                if len(flow):
                    self.wake()  # the next in line looks now

    async def adapter_holders(
        self, target: ModelTarget, name: str, candidates: list[Candidate], deadline: float
    ) -> tuple[list[Candidate], bool]:
        """The candidates that have adapter `name` registered, and whether a load was needed.

        When none has it, it is loaded on the least-loaded candidate (or the load already
        under way is joined) and the request waits for it until `deadline`; when the
        expected load time does not fit before the deadline and the model has a fallback,
        it does not wait (the load goes on, for the requests after it)."""
        holders = [c for c in candidates if self.adapters.has(c.url, name)]
        ref = target.adapter(name)
        if holders or not candidates or ref is None or self.adapter_loads.loader is None:
            return holders, False
        urls = {c.url for c in candidates}
        pending = [u for u in self.adapter_loads.pending(name) if u in urls]
        if pending:
            task = self.adapter_loads.start(pending[0], name, ref.path, labels(target))
        else:  # not where a load of it failed lately (retried after RETRY_FAILED_LOAD_S)
            fresh = [c for c in candidates if not self.adapter_loads.failed(name, c.url)]
            chosen = adapters.load_target(name, fresh)
            if chosen is None:
                return [], True
            task = self.adapter_loads.start(chosen.url, name, ref.path, labels(target))
        left = deadline - time.monotonic()
        if left <= 0 or (target.fallback and self.adapter_loads.expected_seconds > left):
            return [], True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), timeout=left)
        return [c for c in candidates if self.adapters.has(c.url, name)], True

    def adapter_placed(
        self, target: ModelTarget, name: str, route: Route, order: list[Candidate], loaded: bool
    ) -> None:
        """Count where a request naming an adapter went; remember the replica it goes to."""
        if route is Route.REPLICA and order:
            slots = self.adapters.slots(order[0].url, 1)  # vLLM reports max_lora
            self.adapters.sent(order[0].url, name, slots)
            kind = "loaded" if loaded else "resident"
        else:
            kind = "fallback" if route is Route.FALLBACK else "refused"
        self.adapter_metrics.requests.labels(*labels(target), name, kind).inc()

    def best_ttft(
        self, target: ModelTarget, routing: RoutingRequest, candidates: list[Candidate]
    ) -> float:
        """The lowest predicted TTFT among `candidates` (slo-aware admission)."""
        slo = target.slo
        costs = self.predictions.costs(routing, candidates, slo.ttft_seconds, slo.itl_seconds)
        return min(ttft for _, ttft, _ in costs.values())

    # ---------------------------------------------------------------- outcomes

    def debt(self, url: str, now: float) -> float:
        """The low-band prompt tokens `url` still owes under the prefill budget."""
        rate = self.tenancy.settings.flow.headroom_prefill_rate if self.tenancy else None
        owed = self.low_prefill.get(url)
        if not rate or owed is None:
            return 0.0
        return flows.drained(owed[0], now - owed[1], rate)

    def drain_in(self, candidates: list[Candidate], now: float) -> float:
        """Seconds until the first of `candidates` has drained its low-band debt."""
        rate = self.tenancy.settings.flow.headroom_prefill_rate if self.tenancy else None
        if not rate:
            return 0.5
        owed = [d for d in (self.debt(c.url, now) for c in candidates) if d > 0]
        return min(owed) / rate if owed else 0.5

    def dispatched(self, ticket: Ticket, url: str) -> Dispatch:
        """An attempt of `ticket` starts on `url`: the replica's state for its prediction,
        and a low-band request's prompt charged to the replica's prefill budget."""
        caller, tenancy = ticket.caller, self.tenancy
        if caller is not None and tenancy is not None:
            flow = tenancy.settings.flow
            if flow.headroom_prefill_rate and caller.priority < flow.headroom_below:
                now = time.monotonic()
                owed = self.debt(url, now) + max(1, caller.estimate)
                self.low_prefill[url] = (owed, now)
        candidate = next((c for c in ticket.order if c.url == url), None)
        if candidate is None:  # a replica the front end chose itself
            candidate = Candidate(url=url, in_flight=self.load.in_flight.get(url, 0))
        return self.predictions.sent(url, ticket.routing, candidate)

    def answered(
        self,
        target: ModelTarget,
        url: str,
        dispatch: Dispatch,
        ttft: float,
        itl: float | None,
        tokens: int | None = None,
    ) -> None:
        """A whole streamed answer of `url` (`tokens` events carrying text): the
        prediction's error, and the model learns; every SPEED_EVERY answers the model's
        speed factors are published."""
        names = labels(target)
        self.predictions.answered(names, url, dispatch, ttft, itl, tokens)
        self._answers += 1
        if self._answers % SPEED_EVERY == 0:
            self.predictions.publish_speed(names, [e.url for e in target.endpoints])

    def holds_prefill(self, ticket: Ticket) -> bool:
        """Whether `ticket`'s attempts keep low bands off their replica until its first
        token: a stream of a band at or above the headroom line, with `hold_prefill` on."""
        caller, tenancy = ticket.caller, self.tenancy
        if caller is None or tenancy is None or not ticket.stream:
            return False
        flow = tenancy.settings.flow
        return flow.hold_prefill and caller.priority >= flow.headroom_below

    def hold(self, url: str) -> None:
        self.prefilling[url] = self.prefilling.get(url, 0) + 1

    def unhold(self, url: str) -> None:
        left = self.prefilling.get(url, 0) - 1
        if left > 0:
            self.prefilling[url] = left
        else:
            self.prefilling.pop(url, None)
            self.wake()  # low bands may go there now

    def acquire(self, url: str) -> Callable[[], None]:
        """Count one request on replica `url`; the returned callback releases it (once)."""
        return self.load.acquire(url)

    def slot(self, url: str) -> Attempt:
        """An in-flight slot on `url` for a request outside any model (no ticket: no SLO
        outcome, no health verdict); `release()` frees it."""
        return Attempt(None, url, self.load.acquire(url))

    def refused(self, error: Any) -> None:
        """Count a request refused before it named a model (labels empty: no cardinality)."""
        self.metrics.requests.labels("", "", "", "none", str(error.status)).inc()

    def failed(self, url: str, fatal: bool = False) -> None:
        """A replica failed before its first byte. `fatal` (refused, frozen): eject now."""
        if self.outliers.failure(url, fatal=fatal):
            self.topology_changed()
        revisions_failed(self.metrics, self.discovery.snapshot().values(), url)  # canaries

    def succeeded(self, url: str) -> None:
        self.outliers.success(url)

    def routed(
        self, target: ModelTarget, routing: RoutingRequest, url: str, order: list[Candidate]
    ) -> None:
        """The request went to `url`: remember it for prefix affinity, observe the match."""
        ratio = self.router.routed(routing, url, [c.url for c in order])
        self.metrics.target(labels(target)).prefix_match.observe(ratio)

    def completed(self, url: str) -> None:
        """A replica finished an answer: counts toward the rate that predicts queue waits."""
        self.completions.record(url)

    def fallback_slot(self, model: str) -> Callable[[], None]:
        """Hold one of the model's fallback concurrency slots; the callback frees it (once)."""
        self.fallback_in_flight[model] = self.fallback_in_flight.get(model, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.fallback_in_flight[model] -= 1
                self.wake()

        return release


class _InFlightCollector:
    """`kubellm_gateway_endpoint_in_flight{url}`, read from the load view when scraped."""

    def __init__(self, load: LoadView) -> None:
        self.load = load

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            GATEWAY_ENDPOINT_IN_FLIGHT,
            "This front end's requests in flight on each engine endpoint (slots held).",
            labels=["url"],
        )
        for url, count in sorted(list(self.load.in_flight.items())):
            if count > 0:
                family.add_metric([slo.without_credentials(url)], count)
        return [family]
