"""Tenancy in the routing core: the one place both front ends' requests meet the tenants'
rules (`tenants.py`), flow control (`flow.py`) and quotas (`quota.py`).

The scheduler calls it at admission (`identify` from the front end's headers, `admit` for
the quota and the fallback rule, `flow` for the queues) and the ticket at the end (`ended`:
usage metrics, the tenant's fair-share counter, the quota's correction, the fallback
budget). With no tenants configured the scheduler has no `Tenancy` and nothing changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kubellm.gateway.protocol import usage
from kubellm.gateway.protocol.errors import GatewayError
from kubellm.gateway.routing.flow import queues as flows
from kubellm.gateway.routing.flow import quota
from kubellm.gateway.routing.flow.tenants import (
    FAIRNESS_HEADER,
    OBJECTIVE_HEADER,
    PRIORITY_HEADER,
    Tenant,
    Tenants,
    effective_priority,
    flow_id,
)
from kubellm.gateway.routing.latency import metrics as slo
from kubellm.gateway.routing.latency.histogram import Histogram
from prometheus_client import CollectorRegistry, Counter

from kubellm import metrics

if TYPE_CHECKING:
    from kubellm.gateway.routing.lifecycle import Ticket

log = logging.getLogger("kubellm.gateway.tenancy")

_QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(frozen=True)
class TenancySettings:
    """What `--tenants FILE` and its companion flags configure."""

    tenants: Tenants
    flow: flows.FlowSettings = field(default_factory=flows.FlowSettings)
    redis_url: str | None = None  # quotas shared by every gateway replica naming it


def bounded(settings: TenancySettings, max_queue: int) -> TenancySettings:
    """`settings` with flow control's bounds at most the scheduler's `--max-queue`: with
    tenants the queue bound is flow control's, so a full queue sheds a lower band's (or a
    hog's) newest waiter for a newcomer instead of refusing whoever comes next."""
    f = settings.flow
    flow = replace(f, max_band=min(f.max_band, max_queue), max_total=min(f.max_total, max_queue))
    return replace(settings, flow=flow)


@dataclass(eq=False)
class Caller:
    """Who sent one request, at which priority, and its tenancy state until it ends."""

    tenant: Tenant
    priority: int
    flow: str = ""  # its fair-share flow: the tenant, or one of its fairness ids
    estimate: int = 0  # estimated prompt tokens
    reservation: quota.Reservation | None = None  # held in its quotas until its end
    fallback_ok: bool = True  # its tenant's rule lets it reach the fallback now
    charged: float = 0.0  # tokens charged to its fair-share counter at dispatch
    service: float = 0.0  # expected service: prompt + 2 x the answer it may have
    # (model, band, service) counted in flow control's in-flight service until its end
    holding: tuple[str, int, float] | None = None


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            metrics.GATEWAY_TENANT_REQUESTS.removesuffix("_total"),
            "Requests answered per tenant, by route (replica|fallback|none) and HTTP status.",
            ["tenant", "target", "code"],
            registry=r,
        )
        self.tokens = Counter(
            metrics.GATEWAY_TENANT_TOKENS.removesuffix("_total"),
            "Tokens served per tenant, by route (replica|fallback) and kind.",
            ["tenant", "target", "kind"],
            registry=r,
        )
        self.queue = Histogram(
            metrics.GATEWAY_TENANT_QUEUE,
            "Seconds a tenant's requests waited for admission.",
            ["tenant"],
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        self.goodput = Counter(
            metrics.GATEWAY_TENANT_GOODPUT.removesuffix("_total"),
            "A tenant's answers meeting the model's TTFT and ITL targets.",
            ["tenant"],
            registry=r,
        )
        self.dropped = Counter(
            metrics.GATEWAY_TENANT_DROPPED.removesuffix("_total"),
            "Requests flow control dropped (band-full, queue-full, shed, ttl).",
            ["tenant", "reason"],
            registry=r,
        )
        self.throttled = Counter(
            metrics.GATEWAY_TENANT_THROTTLED.removesuffix("_total"),
            "Requests refused by a tenant's quota (limit: requests or tokens per minute).",
            ["tenant", "limit"],
            registry=r,
        )
        self.ttft = Histogram(
            metrics.GATEWAY_TENANT_TTFT,
            "Time to first token per tenant, as the model's series counts it (queue wait "
            "included; a non-streamed answer's whole time).",
            ["tenant"],
            buckets=slo.LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            metrics.GATEWAY_TENANT_ITL,
            "Time between streamed events carrying text, per tenant.",
            ["tenant"],
            buckets=slo.ITL_BUCKETS,
            registry=r,
        )


class Tenancy:
    """Tenants, their queues and quotas, for one gateway process."""

    def __init__(
        self,
        settings: TenancySettings,
        registry: CollectorRegistry,
        store: quota.Store | None = None,
    ) -> None:
        self.settings = settings
        self.tenants = settings.tenants
        if store is None:
            store = (
                quota.RedisStore(settings.redis_url) if settings.redis_url else quota.MemoryStore()
            )
        self.store = store
        self.limiter = quota.Limiter(quota.Breaker(store, registry))  # fails open at once
        self.metrics = TenantMetrics(registry)
        self.flows: dict[str, flows.Flow] = {}
        self.outputs: dict[str, float] = {}  # tenant -> its recent largest answer (tokens)
        self._tasks: set[asyncio.Task[None]] = set()
        for tenant in self.tenants.tenants:  # every declared tenant shows, even at 0
            for code_route in ("replica", "fallback"):
                for kind in ("prompt", "completion"):
                    self.metrics.tokens.labels(tenant.name, code_route, kind)
            self.metrics.ttft.labels(tenant.name)
            self.metrics.itl.labels(tenant.name)

    # ------------------------------------------------------------ admission

    def identify(self, headers: Mapping[str, str]) -> Caller:
        """The caller of a request from its headers (lower-case names): `authorization`,
        `x-kubellm-priority`, and the Inference Extension's objective and fairness id
        (401: an unknown key, or none without a default tenant; 400: a bad priority)."""
        tenant = self.tenants.identify(headers.get("authorization"))
        priority = effective_priority(
            tenant,
            headers.get(PRIORITY_HEADER),
            headers.get(OBJECTIVE_HEADER),
            self.tenants.objectives,
        )
        return Caller(tenant, priority, flow_id(tenant, headers.get(FAIRNESS_HEADER)))

    async def admit(self, caller: Caller, body: object) -> GatewayError | None:
        """The quota check (and charge) and the fallback rule; a refusal, or None."""
        tenant = caller.tenant
        parsed = body if isinstance(body, dict) else None
        caller.estimate = flows.estimate_prompt_tokens(parsed)
        output = flows.expected_output_tokens(parsed, self.outputs.get(tenant.name))
        caller.service = caller.estimate + flows.OUTPUT_WEIGHT * output
        rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
        reservation = quota.Reservation(caller.estimate + usage.output_bound(parsed))
        caller.reservation = reservation
        try:
            if rpm is not None or tpm is not None:
                verdict = await self.limiter.admit(tenant.name, reservation, rpm, tpm)
                if not verdict.allowed:  # nothing charged (taken back): nothing to settle
                    self.metrics.throttled.labels(tenant.name, verdict.which).inc()
                    return quota.refusal(tenant.name, verdict)
            rule = tenant.fallback
            if rule.kind == "never":
                caller.fallback_ok = False
            elif rule.kind == "budget":  # reserved before it may be sent (quota.py)
                caller.fallback_ok = await self.limiter.reserve_fallback(
                    tenant.name, reservation, rule.tokens_per_day
                )
        except Exception as error:  # never a traceback for the client
            log.warning("quota check failed (%s); admitting without a quota check", error)
            caller.fallback_ok = caller.fallback_ok and tenant.fallback.kind == "allowed"
        return None

    def flow(self, model: str) -> flows.Flow:
        found = self.flows.get(model)
        if found is None:
            found = self.flows[model] = flows.Flow(self.settings.flow)
        return found

    def waiter(self, caller: Caller) -> flows.Waiter:
        tenant = caller.tenant
        return flows.Waiter(
            caller.flow,
            caller.priority,
            tenant.weight,
            caller.estimate,
            caller.fallback_ok,
            service=caller.service,
        )

    def dispatched(self, model: str, caller: Caller, waited: float, replica: bool) -> None:
        """The request left its queue (to a replica when `replica`)."""
        self.metrics.queue.labels(caller.tenant.name).observe(waited)
        if replica and caller.reservation is not None and caller.reservation.day is not None:
            self._later(self.limiter.release_fallback(caller.tenant.name, caller.reservation))
        if replica:
            caller.charged = caller.estimate
            flow = self.flow(model)
            flow.charge(caller.flow, caller.estimate, caller.tenant.weight)
            if caller.holding is None:
                caller.holding = (model, caller.priority, caller.service)
                flow.started(caller.priority, caller.flow, caller.service)

    def dropped(self, caller: Caller, reason: str, error: GatewayError | None) -> None:
        self.metrics.dropped.labels(caller.tenant.name, reason).inc()
        if error is not None:
            error.headers[flows.DROP_HEADER] = reason

    # ------------------------------------------------------------ the end

    def ended(self, ticket: Ticket, caller: Caller) -> None:
        """Count the request's outcome and tokens for its tenant; correct its counters."""
        if caller.holding is not None:  # no longer in flight (fair in-flight budget)
            model, band, service = caller.holding
            caller.holding = None
            self.flow(model).ended(band, caller.flow, service)
        name = caller.tenant.name
        m = self.metrics
        status = ticket.status or 499
        m.requests.labels(name, ticket.route, str(status)).inc()
        if ticket.good:
            m.goodput.labels(name).inc()
        if ticket.ttft is not None:  # what the model's TTFT and ITL series counted
            m.ttft.labels(name).observe(ticket.ttft)
            m.itl.labels(name).observe_all(ticket.timing.gaps)
        served = ticket.served_tokens()
        if caller.reservation is not None and caller.reservation.held:  # settled on it
            used = None if served is None else served[0] + served[1]
            fallback = ticket.route == "fallback"
            self._later(self.limiter.settle(name, caller.reservation, used, fallback))
        if served is None or ticket.route not in ("replica", "fallback"):
            return
        prompt, completion = served
        m.tokens.labels(name, ticket.route, "prompt").inc(prompt)
        m.tokens.labels(name, ticket.route, "completion").inc(completion)
        if ticket.route == "replica" and status == 200:
            self.outputs[name] = flows.observed_output(self.outputs.get(name), completion)
            served_service = prompt + flows.OUTPUT_WEIGHT * completion - caller.charged
            flow = self.flow(ticket.target.served_name)
            flow.charge(caller.flow, served_service, caller.tenant.weight)

    def _later(self, work: object) -> None:
        """Run a store update without holding the request's end on it."""
        try:
            task = asyncio.get_running_loop().create_task(_quietly(work))  # type: ignore[arg-type]
        except RuntimeError:  # no loop (a synchronous test): drop it
            work.close()  # type: ignore[attr-defined]
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        close = getattr(self.store, "close", None)
        if close is not None:
            await close()


async def _quietly(work: object) -> None:
    try:
        await work  # type: ignore[misc]
    except Exception as error:
        log.warning("quota store update failed: %s", error)
