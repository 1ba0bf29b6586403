"""The flow-control gate: how a tenant's share is enforced in the admission pass.

It wraps `routing/flow/controller.py` (tenants, quotas, counters) and `flow/queues.py` (queues
per band x tenant, fairness): when tenants are declared, a request joins its model's flow
(`enter`; joining may shed others), and on each pass

- a request shed by flow control is dropped (429, its reason);
- a request that is not at the head of the flow (`Flow.head`, within the fair in-flight
  budget, `flow.fair_capacity`) gets no replica; it may take the fallback
  only when it is next in line for it;
- a request of a band under `headroom_below` keeps off the replicas above the headroom
  line (`flow.below_line`: the engine's queue, KV usage, load, a high-band stream still
  awaiting its first token there with `hold_prefill`, the low-band prefill debt under
  the prefill budget); with none left it waits for one (not the paid fallback).

The prefill budget's rate is `headroom_prefill_rate` when set; else, with
`headroom_prefill_learnt` (the default), each replica's prefill speed learnt from its scrapes
(`LoadView.prefill_rate`), and only while a band at or above `headroom_below` sent a request
to the model in the last `HIGH_RECENT_S`: a batch tenant alone is not paced.

On a decision its band's TTL turns a saturated refusal at the deadline into "ttl", and the
tenant's queue time and in-flight share are counted (`Tenancy.dispatched`). Through the
ticket: a low band's prompt is charged to the replica's prefill debt, a high band's stream
holds low bands off its replica until its first token, and the request's end is counted
for its tenant (`Tenancy.ended`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubellm.gateway.routing.flow.controller import Caller, Tenancy
    from kubellm.gateway.routing.lifecycle import Ticket

from kubellm.gateway.routing.admission import Route
from kubellm.gateway.routing.dispatch import WAKE_IN, Decision, Gate, Pass
from kubellm.gateway.routing.flow import queues as flows
from kubellm.gateway.routing.scorers.base import Candidate

# The learnt prefill budget paces low bands while a high band sent within this many seconds.
HIGH_RECENT_S = 30.0


class FlowGate(Gate):
    """Flow control for one gateway process (`tenancy` None: no tenants, it lets all by)."""

    def __init__(
        self,
        tenancy: Tenancy | None,
        wake: Callable[[], None],
        prefill_rate: Callable[[str], float | None] = lambda url: None,
        cached_share: Callable[[str, Ticket], float] = lambda url, ticket: 0.0,
    ) -> None:
        self.tenancy = tenancy
        self.wake = wake  # capacity may have freed: queued requests look again
        self.prefill_rate = prefill_rate  # a replica's learnt prefill speed (LoadView's)
        # the share of a ticket's prompt a replica holds cached (the router's prefix index):
        # the learnt speed counts computed tokens, so a prompt owes only its part not cached
        self.cached_share = cached_share
        # model -> when a band at or above headroom_below last dispatched to a replica
        self.high_at: dict[str, float] = {}
        # replica -> high-band streams sent there still awaiting their first token
        # (`hold_prefill`): low bands do not dispatch there meanwhile
        self.prefilling: dict[str, int] = {}
        # replica -> (low-band prompt tokens owed, when) under `headroom_prefill_rate`
        self.low_prefill: dict[str, tuple[float, float]] = {}

    def identify(self, headers: Mapping[str, str]) -> Caller | None:
        """The tenant of a request from its headers, names in lower case (None: no tenants
        declared); raises the 401 or 400 to answer (`Tenancy.identify`)."""
        return None if self.tenancy is None else self.tenancy.identify(headers)

    # ------------------------------------------------------------ the pass

    def enter(self, p: Pass) -> None:
        caller, tenancy = p.caller, self.tenancy
        if caller is None or tenancy is None:
            return
        waiter = p.waiter = tenancy.waiter(caller)
        if tenancy.flow(p.target.served_name).join(waiter):
            self.wake()  # shed waiters look again, and go
        ttl = tenancy.settings.flow.ttl_seconds  # sheddable: may wait its band's TTL
        budget = ttl if caller.priority < 0 else min(p.deadline - p.start, ttl)
        p.deadline = p.start + budget
        p.dropped = waiter.dropped

    def narrow(self, p: Pass) -> None:
        waiter, tenancy = p.waiter, self.tenancy
        if waiter is None or tenancy is None:
            return
        if waiter.dropped:  # shed while waiting
            p.dropped = waiter.dropped
            return
        settings = tenancy.settings.flow
        flow = tenancy.flow(p.target.served_name)
        capped = frozenset[tuple[int, str]]()
        if settings.fair_in_flight:  # fair in-flight budget
            flow.learn(p.candidates)
            capacity = flows.fair_capacity(settings, flow, p.candidates, p.thresholds.max_in_flight)
            capped = flow.held(capacity) if capacity else capped
        if flow.head(held=capped) is not waiter:  # not its turn for a replica: wait, and
            p.open = []  # the fallback only when next in line for it
            if flow.head(fallback=True, held=capped) is not waiter:
                p.fallback = None
        elif waiter.band < settings.headroom_below:
            now, held, model, slots = p.now, self.prefilling, p.target.served_name, flow.slots.get
            if not settings.fair_in_flight:
                flow.learn(p.candidates)
            below = [
                c
                for c in p.open
                if flows.below_line(
                    c, settings, held.get(c.url, 0), self.debt(c.url, model, now), slots(c.url)
                )
            ]
            if p.open and not below:  # room kept for high bands: wait for it, the paid
                p.fallback = None  # API is not for sheddable overflow
                p.wake_in = self.drain_in(p.open, model, now)  # or for a debt to drain
            p.open = below

    def decided(self, p: Pass, decision: Decision) -> Decision:
        caller, tenancy = p.caller, self.tenancy
        if caller is None or tenancy is None:
            return decision
        rejected = decision.route is Route.REJECT and decision.reason == "saturated"
        if rejected and p.now >= p.deadline:  # its band's TTL ran out
            decision = Decision(Route.REJECT, "ttl", decision.order, decision.loading)
        tenancy.dispatched(
            p.target.served_name, caller, p.now - p.start, decision.route is Route.REPLICA
        )
        return decision

    def leave(self, p: Pass) -> None:
        if p.waiter is None or self.tenancy is None:
            return
        flow = self.tenancy.flow(p.target.served_name)
        flow.leave(p.waiter)
        if len(flow):
            self.wake()  # the next in line looks now

    # ------------------------------------------------------------ the low bands' headroom

    def rate(self, url: str, model: str, now: float) -> float | None:
        """The prefill budget's rate on `url` (tokens/s), None for no budget: the flag's,
        else the replica's learnt prefill speed while a high band is about."""
        if self.tenancy is None:
            return None
        settings = self.tenancy.settings.flow
        if settings.headroom_prefill_rate:
            return settings.headroom_prefill_rate
        recent = now - self.high_at.get(model, -HIGH_RECENT_S) < HIGH_RECENT_S
        return self.prefill_rate(url) if settings.headroom_prefill_learnt and recent else None

    def debt(self, url: str, model: str, now: float) -> float:
        """The low-band prompt tokens `url` still owes under the prefill budget."""
        rate, owed = self.rate(url, model, now), self.low_prefill.get(url)
        if not rate or owed is None:
            return 0.0
        return flows.drained(owed[0], now - owed[1], rate)

    def drain_in(self, candidates: list[Candidate], model: str, now: float) -> float:
        """Seconds until the first of `candidates` has drained its low-band debt."""
        waits = [
            self.debt(c.url, model, now) / (self.rate(c.url, model, now) or 1.0) for c in candidates
        ]
        return min((w for w in waits if w > 0), default=WAKE_IN)

    def forget(self, keep: set[str]) -> None:
        """Replicas outside `keep` left: their debts go."""
        self.low_prefill = {u: owed for u, owed in self.low_prefill.items() if u in keep}

    # ------------------------------------------------------------ the ticket's

    def sent(self, ticket: Ticket, url: str) -> None:
        caller, tenancy = ticket.caller, self.tenancy
        if caller is None or tenancy is None:
            return
        settings, now, model = tenancy.settings.flow, time.monotonic(), ticket.target.served_name
        high = caller.priority >= settings.headroom_below
        if high:
            self.high_at[model] = now
        elif self.rate(url, model, now):
            computed = caller.estimate * (1.0 - self.cached_share(url, ticket))
            owed = self.debt(url, model, now) + max(1.0, computed)
            self.low_prefill[url] = (owed, now)
        if ticket.stream and settings.hold_prefill and high and not ticket.done:
            ticket.hold = url  # a high band's stream: low bands keep off until it streams
            self.prefilling[url] = self.prefilling.get(url, 0) + 1

    def first_token(self, ticket: Ticket, now: float) -> None:
        self.over(ticket)

    def over(self, ticket: Ticket, learn: bool = False) -> None:
        url, ticket.hold = ticket.hold, None
        if url is None:
            return
        left = self.prefilling.get(url, 0) - 1
        if left > 0:
            self.prefilling[url] = left
        else:
            self.prefilling.pop(url, None)
            self.wake()  # low bands may go there now

    def ended(self, ticket: Ticket) -> None:
        caller, tenancy = ticket.caller, self.tenancy
        if caller is None or tenancy is None:
            return
        holding = caller.holding
        tenancy.ended(ticket, caller)
        if holding is not None and tenancy.settings.flow.fair_in_flight:
            self.wake()  # a tenant held at its fair in-flight share may go now
