"""One admission pass: where one request goes now, or that it waits (pure).

The scheduler (and the simulations, on their simulated clocks) runs the pass again and
again for a waiting request: `admit_once(pass_, gates, router)` reads the state of the
pass (`Pass`), lets each gate narrow it in order, asks `admission.decide` for the route,
and orders the replicas; it answers a `Decision`, or None: wait (queue, or a load named
in `Pass.awaiting`), and run the pass again when something changed.

    candidates (router.candidates: routable, not ejected, not down)
      -> open: the candidates not saturated (admission.saturated)
      -> gates, in order, each narrowing the pass:
           adapters (gates/adapters.py)  only the replicas holding the request's adapter;
                                         none: a load starts and the pass awaits it
           flow     (gates/flow.py)      tenancy: dropped, not its turn (no replica, the
                                         fallback only when next in line for it), the
                                         headroom kept for high bands, the prefill hold
           slo      (gates/slo.py)       slo-aware: the best predicted TTFT among the open
      -> the request's revision's (router.narrow: the revision filter, while a canary
         splits the model), so the route is decided on the replicas that may answer it
      -> admission.decide: REPLICA / FALLBACK / REJECT, or QUEUE (None: wait)
      -> order: router.order over the open ones (the profile: the revision filter first,
         then the policy's filters and scorers), then the saturated candidates of the
         request's revision (alive: better than no answer), then the other revision's
         (a retry reaches them only after every replica of its own failed; never in the
         shadow step, whose canary answers mirrored requests only)
      -> each gate hears the decision (`decided`)

A gate also hears the request's attempts through its ticket (`lifecycle.Ticket`): `sent`
(an attempt starts on a replica), `first_token`, `over` (the attempt owes no more
prefill: it streamed, failed, was replaced, or the request ended; `learn`: it ended whole)
and `ended` (the request's end).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kubellm.gateway.discovery.base import FallbackTarget, ModelTarget
from kubellm.gateway.routing.admission import Route, decide, predicted_wait, saturated
from kubellm.gateway.routing.canary.revisions import last_resort
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.settings import Thresholds

if TYPE_CHECKING:
    from kubellm.gateway.routing.flow.controller import Caller
    from kubellm.gateway.routing.lifecycle import Ticket

__all__ = ["WAKE_IN", "Decision", "Gate", "Hooks", "Pass", "Router", "admit_once"]

WAKE_IN = 0.5  # a waiting request passes again at least this often (seconds)


@dataclass
class Pass:
    """The state of one request's admission, refreshed before each pass (`refresh`)."""

    target: ModelTarget
    routing: RoutingRequest
    start: float  # when admission began (the queue wait is counted from it)
    deadline: float  # the wait budget's end (gates may bring it forward)
    ready: bool  # the model had a replica at the start: the budget is its TTFT target
    thresholds: Thresholds = field(default_factory=Thresholds)
    caller: Caller | None = None  # its tenant, when tenants are declared
    # completions per second over some replicas: predicts the wait for a slot
    rate: Callable[[Iterable[str]], float] = lambda urls: 0.0
    candidates: list[Candidate] = field(default_factory=list)
    open: list[Candidate] = field(default_factory=list)
    fallback: FallbackTarget | None = None
    fallback_in_flight: int = 0
    now: float = 0.0
    position: int = 1  # its place in the model's queue (1: next)
    room: bool = True  # it is queued, or the queue has room for it
    dropped: str | None = None  # a gate refused it (flow control): the reason
    predicted: float | None = None  # the best predicted TTFT (slo-aware)
    wake_in: float = WAKE_IN  # look again within this many seconds
    awaiting: Awaitable[Any] | None = None  # wait for this (an adapter load), then pass again
    waited: bool = False  # the last wait was for `awaiting`
    loaded: bool = False  # an adapter was loaded for it
    waiter: Any = None  # its place in the flow's queues (flow gate)

    def refresh(
        self,
        target: ModelTarget,
        candidates: list[Candidate],
        now: float,
        fallback: FallbackTarget | None,
        fallback_in_flight: int,
        position: int,
        room: bool,
    ) -> None:
        """What the fleet looks like for the next pass."""
        self.target, self.candidates, self.now = target, candidates, now
        self.fallback, self.fallback_in_flight = fallback, fallback_in_flight
        self.position, self.room = position, room
        self.predicted, self.wake_in = None, WAKE_IN


class Decision(NamedTuple):
    """Where the request goes: the route, its reason, the replicas best first (a replica
    route), and the adapter still loading when it is refused (for the refusal's words).
    (A tuple, not a frozen dataclass: one is built per request, and a frozen dataclass
    costs twice as much to build.)"""

    route: Route
    reason: str
    order: Sequence[Candidate] = ()
    loading: str | None = None


class Router(Protocol):
    """What the pass asks of the router (`routing.router.Router`)."""

    def order(
        self, target: ModelTarget, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> list[Candidate]: ...

    def narrow(
        self, target: ModelTarget, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> list[Candidate]: ...


class Gate:
    """A gate of the pass; each hook does nothing unless a gate overrides it."""

    def enter(self, p: Pass) -> None:
        """Admission of the request begins (before its first pass)."""

    def narrow(self, p: Pass) -> None:
        """Narrow the pass: `candidates`, `open`, `fallback`, `deadline`; set `dropped`,
        `predicted`, `wake_in` or `awaiting`."""

    def decided(self, p: Pass, decision: Decision) -> Decision:
        """The pass decided (not a wait): the decision, possibly reworded."""
        return decision

    def leave(self, p: Pass) -> None:
        """Admission of the request is over (whatever the outcome)."""

    def sent(self, ticket: Ticket, url: str) -> None:
        """An attempt of `ticket` starts on `url`."""

    def first_token(self, ticket: Ticket, now: float) -> None:
        """The current attempt's first generated text arrived at `now`."""

    def over(self, ticket: Ticket, learn: bool = False) -> None:
        """The current attempt owes no more prefill (`learn`: the answer ended whole, 200)."""

    def ended(self, ticket: Ticket) -> None:
        """The request ended (counted)."""


class Hooks:
    """The gates' hooks that do something, per hook, in the gates' order (a ticket calls
    these on every request: no call to a hook a gate left as it is)."""

    def __init__(self, gates: Sequence[Gate]) -> None:
        def overriding(name: str) -> tuple[Callable[..., Any], ...]:
            base = getattr(Gate, name)
            return tuple(getattr(g, name) for g in gates if getattr(type(g), name) is not base)

        self.enter = overriding("enter")
        self.leave = overriding("leave")
        self.sent = overriding("sent")
        self.first_token = overriding("first_token")
        self.over = overriding("over")
        self.ended = overriding("ended")


def admit_once(p: Pass, gates: Sequence[Gate], router: Router) -> Decision | None:
    """One pass of admission for `p`: a decision, or None (wait, and pass again)."""
    if p.dropped is not None:
        return Decision(Route.REJECT, p.dropped)
    thresholds = p.thresholds
    p.open = [c for c in p.candidates if not saturated(c, thresholds)]
    for gate in gates:
        gate.narrow(p)
        if p.dropped is not None:
            return Decision(Route.REJECT, p.dropped)
        if p.awaiting is not None:
            return None
    open_, every, now = p.open, p.candidates, p.now
    candidates = every  # the request's revision's, while a canary splits the model
    if p.target.canary is not None:
        candidates = router.narrow(p.target, p.routing, every)
        own = {c.url for c in candidates}
        open_ = [c for c in open_ if c.url in own]
    rate = 0.0 if open_ else p.rate(c.url for c in candidates)
    verdict = decide(
        ready=len(candidates),
        unsaturated=len(open_),
        fallback=p.fallback,
        fallback_in_flight=p.fallback_in_flight,
        may_wait=p.room and now < p.deadline,
        wait=predicted_wait(p.position, rate),
        budget_left=p.deadline - now if p.ready else 0.0,
        predicted_ttft=p.predicted,
    )
    if verdict.route is Route.QUEUE:
        return None
    order = router.order(p.target, p.routing, open_) if open_ else []
    if order and len(order) < len(every):  # then the saturated ones (alive, so better than
        chosen = {c.url for c in order}  # no answer), its revision's, then the other's
        order += [c for c in candidates if c.url not in chosen]
        if candidates is not every and last_resort(p.target):  # only after all its own
            order += [c for c in every if c.url not in own]
    decision = Decision(verdict.route, verdict.reason, order)
    for gate in gates:
        decision = gate.decided(p, decision)
    return decision
