"""Flow control: which waiting request dispatches next, and which is shed.

Requests of one model that cannot be dispatched at once wait in queues per priority band x
tenant. The decisions are pure (the caller passes the clock's reading):

- **Order.** Strict by band (the request's priority, higher first). Inside a band, fair by
  service: each tenant has a virtual token counter (VTC; Sheng et al., "Fairness in Serving
  Large Language Models", OSDI 2024) that grows by the tokens the pool served it, divided
  by its weight (prompt tokens + 2 x output tokens, the paper's measure); the backlogged
  tenant with the lowest counter goes next, FIFO within a tenant. A tenant that was not
  backlogged has its counter lifted to the lowest counter of those that are when it joins
  (the paper's rule), so idling earns no credit to flood the pool with later.
- **Bounds.** A band holds at most `max_band` waiters (a request past it is dropped,
  `band-full`), the model at most `max_total` (a request past it sheds the newest waiter of
  the lowest sheddable band below its own, `shed`, or is dropped itself, `queue-full`);
  each waiter waits at most its band's TTL (`ttl`). The reason goes back in the
  `x-kubellm-drop-reason` header and `kubellm_gateway_tenant_dropped_total`.
- **Headroom.** Requests of bands below `headroom_below` (default 0: the sheddable ones)
  dispatch only to replicas below a lower saturation line (`below_line`): no engine queue,
  KV usage under `headroom_kv`, and load under `headroom_load` when set (else 3/4 of the
  replica's learnt slots; not learnt yet: `LOW_RAMP` past its last scrape). The rest of each
  replica stays free for the high bands, so a chat request finds a slot at once instead of
  waiting inside the engine behind batch work; low bands still use every replica while the
  high ones are idle (work-conserving up to the line).
- **Prefill hold** (`hold_prefill`, on by default). While a high-band stream sent to a
  replica awaits its first token, low bands dispatch elsewhere: a long batch prompt sent
  beside it would share its prefill's engine steps (chunked prefill fills each step's token
  budget in arrival order) and delay its first token by its own prefill time. The hold
  lasts one prefill; the replica takes low bands again at the first token.
- **Prefill budget** (`headroom_prefill_rate`, tokens/s per replica, off by default). Each
  low-band dispatch adds its estimated prompt tokens to its replica's debt, which drains at
  that rate; a low band dispatches only to a replica whose debt has drained (a token
  bucket holding one request). Batch prompts reach a replica one at a time, spaced by their
  prefill at that rate, instead of several landing in one engine step when a scrape or a
  few completions free room at once: a chat prompt that arrives then waits for, and
  shares, one batch prefill at most.
- **Fair in-flight budget** (`fair_in_flight_tokens`, service tokens per replica; by
  default derived from the pool, `fair_capacity`). VTC orders the gateway's queue, but a
  queue only exists while the replicas refuse work: when they accept everything, a tenant
  of 8,000-token prompts holds most of every engine step and a tenant of 200-token
  prompts, all of its requests in flight already, is served only as fast as those steps
  let it (Little's law: a tenant's service rate is its service in flight over its
  requests' latency, and the requests sharing the steps share the latency). With the
  budget set, each band's tenants share `replicas x fair_in_flight_tokens` of service in
  flight (prompt + 2 x expected output tokens of the requests dispatched and not ended) by
  weighted water-filling: a tenant asking less than its share (nothing waiting) keeps what
  it has in flight, the rest is split by weight among the tenants waiting; a waiting
  tenant at its allowance is `held` (it waits, and the next tenant by counter goes
  instead). A tenant with nothing in flight whose next request is larger than its share
  goes when its counter is the band's lowest (so a tenant of 8,000-token prompts can be
  held to a quarter of a budget smaller than one of them, over time, and is never
  starved), and a band with one active tenant has no bound (alone, it uses the whole
  fleet). The cost: while tenants contend, the fleet holds at most that much service, so
  prompt tokens per second fall (the bench measures it).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubellm.gateway.routing.scorers.base import Candidate
from kubellm.gateway.routing.settings import FlowSettings

DROP_HEADER = "x-kubellm-drop-reason"
MAX_FLOWS = 10_000  # fair-share counters kept per model (idle flows forgotten past it)
# the VTC measure: an output token costs this many prompt tokens
OUTPUT_WEIGHT = 2.0
RECENT_SERVICES = 256  # dispatched requests whose quantile is the typical one (fair_capacity)
# the derived fair budget: each replica's slots x this x the typical request's service
FAIR_SLOTS = 1.5
FAIR_QUANTILE = 0.25  # ... and the typical request is this quantile of the last ones
LOW_RAMP = 4  # (below_line) low-band requests a replica of unknown slots takes per scrape


@dataclass(eq=False)
class Waiter:
    """One request waiting for its turn."""

    tenant: str  # its flow: the tenant, or one of its fairness ids (tenants.flow_id)
    band: int
    weight: float
    cost: float  # its estimated prompt tokens (charged to the VTC when it dispatches)
    fallback: bool = True  # its tenant may use the fallback API now
    service: float = 0.0  # its expected service (prompt + 2 x output tokens) in flight
    seq: int = 0
    dropped: str | None = None  # why it was shed while waiting


@dataclass
class Flow:
    """The queues of one model."""

    settings: FlowSettings = field(default_factory=FlowSettings)
    queues: dict[int, dict[str, deque[Waiter]]] = field(default_factory=dict)
    vtc: dict[str, float] = field(default_factory=dict)  # tenant -> its counter (by weight)
    flow_vtc: dict[str, float] = field(default_factory=dict)  # flow -> its counter in its tenant
    # band -> flow -> expected service of its requests dispatched to replicas, not ended
    in_flight: dict[int, dict[str, float]] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)  # tenant -> weight
    # replica URL -> its request slots (maxNumSeqs) as learnt from its scrapes (`learn`)
    slots: dict[str, float] = field(default_factory=dict)
    # the expected service of the requests dispatched last (the derived fair budget)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_SERVICES))
    _typical: float | None = None  # their quantile, None when `recent` changed since
    _seq: Any = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return sum(len(q) for band in self.queues.values() for q in band.values())

    def band_length(self, band: int) -> int:
        return sum(len(q) for q in self.queues.get(band, {}).values())

    def backlogged(self) -> set[str]:
        return {t for band in self.queues.values() for t, q in band.items() if q}

    def join(self, waiter: Waiter) -> list[Waiter]:
        """Queue `waiter`; returns the waiters dropped to bound the queues (`waiter` itself
        when it cannot be kept), each with its `dropped` reason set. A full band sheds the
        newest waiter of its tenant holding the most places per weight (`_hog`), else the
        newcomer is refused (`band-full`); a full model sheds the newest waiter of the
        lowest sheddable band below the newcomer's (`_victim`), else a hog of its own band,
        else refuses it (`queue-full`)."""
        s = self.settings
        shed: list[Waiter] = []
        for reason in ("band-full", "queue-full"):
            if reason == "band-full":
                if self.band_length(waiter.band) < s.max_band:
                    continue
                victim = self._hog(waiter)
            else:
                if len(self) < s.max_total:
                    continue
                victim = self._victim(waiter.band) or self._hog(waiter)
            if victim is None:
                waiter.dropped = reason
                return [*shed, waiter]
            victim.dropped = "shed"
            self.leave(victim)
            shed.append(victim)
        owner = owner_of(waiter.tenant)
        backlogged = self.backlogged()
        owners = {owner_of(t) for t in backlogged}
        if len(self.flow_vtc) > MAX_FLOWS:  # flows named by fairness ids: forget the idle ones
            self.flow_vtc = {t: v for t, v in self.flow_vtc.items() if t in backlogged}
        if owner not in owners:  # VTC's lift: no credit for idle time
            _lift(self.vtc, owner, [self.vtc.get(o, 0.0) for o in owners])
        if waiter.tenant not in backlogged:  # nor for a new flow of the tenant's own
            mine = [self.flow_vtc.get(t, 0.0) for t in backlogged if owner_of(t) == owner]
            _lift(self.flow_vtc, waiter.tenant, mine)
        waiter.seq = next(self._seq)
        self.weights[owner] = waiter.weight
        self.queues.setdefault(waiter.band, {}).setdefault(waiter.tenant, deque()).append(waiter)
        return shed

    def _hog(self, waiter: Waiter) -> Waiter | None:
        """The newest waiter of the tenant holding the most of `waiter`'s band per unit of
        weight, when it holds more than `waiter`'s tenant would by joining (one tenant
        cannot keep a band's whole queue from another)."""
        held: dict[str, list[Waiter]] = {}
        for flow, queue in self.queues.get(waiter.band, {}).items():
            held.setdefault(owner_of(flow), []).extend(queue)
        owner = owner_of(waiter.tenant)
        mine = (len(held.get(owner, [])) + 1) / max(waiter.weight, 1e-9)
        worst = max(
            (o for o in held if o != owner),
            key=lambda o: len(held[o]) / self.weights.get(o, 1.0),
            default=None,
        )
        if worst is None or len(held[worst]) / self.weights.get(worst, 1.0) <= mine:
            return None
        return max(held[worst], key=lambda w: w.seq)

    def _victim(self, band: int) -> Waiter | None:
        """The newest waiter of the lowest sheddable band below `band`."""
        for low in sorted(self.queues):
            if low >= band or low >= 0:
                return None
            newest = [q[-1] for q in self.queues[low].values() if q]
            if newest:
                return max(newest, key=lambda w: w.seq)
        return None

    def leave(self, waiter: Waiter) -> None:
        """Take `waiter` out (it dispatched, was refused, or left)."""
        band = self.queues.get(waiter.band)
        if band is None:
            return
        queue = band.get(waiter.tenant)
        if queue is None:
            return
        try:
            queue.remove(waiter)
        except ValueError:
            return
        if not queue:
            del band[waiter.tenant]
            if not band:
                del self.queues[waiter.band]

    def head(
        self, fallback: bool = False, held: frozenset[tuple[int, str]] = frozenset()
    ) -> Waiter | None:
        """The waiter that dispatches next: the highest band, the tenant with the lowest
        counter in it, that tenant's flow with the lowest counter (ties: the earlier
        arrival), the flow's oldest request. `fallback`: among those
        whose tenant may use the fallback API (who goes there next: a `never` tenant's
        request waiting for a replica does not hold the fallback from lower bands).
        `held`: (band, flow) pairs at their fair in-flight allowance (`held`), passed over."""
        for band in sorted(self.queues, reverse=True):
            best: Waiter | None = None
            best_key: tuple[float, float, int] | None = None
            for tenant, queue in self.queues[band].items():
                if (band, tenant) in held:
                    continue
                first = queue[0]
                if fallback:
                    first = next((w for w in queue if w.fallback), None)
                    if first is None:
                        continue
                key = (
                    self.vtc.get(owner_of(tenant), 0.0),
                    self.flow_vtc.get(tenant, 0.0),
                    first.seq,
                )
                if best_key is None or key < best_key:
                    best, best_key = first, key
            if best is not None:
                return best
        return None

    def started(self, band: int, tenant: str, service: float) -> None:
        """A request of `tenant` in `band` went to a replica with `service` expected."""
        flows = self.in_flight.setdefault(band, {})
        flows[tenant] = flows.get(tenant, 0.0) + service
        self.recent.append(service)
        self._typical = None

    def typical(self) -> float | None:
        """The `FAIR_QUANTILE` quantile of the expected service of the last
        `RECENT_SERVICES` dispatched requests: by count, so tenants sending as many short
        requests as long ones give a short typical request (their median would be the
        middle tenant's)."""
        if self._typical is None and self.recent:
            ordered = sorted(self.recent)
            self._typical = ordered[int(FAIR_QUANTILE * len(ordered))]
        return self._typical

    def ended(self, band: int, tenant: str, service: float) -> None:
        """That request ended (once per `started`)."""
        flows = self.in_flight.get(band)
        if flows is None or tenant not in flows:
            return
        left = flows[tenant] - service
        if left > 1e-6:
            flows[tenant] = left
        else:
            del flows[tenant]
            if not flows:
                del self.in_flight[band]

    def held(self, capacity: float) -> frozenset[tuple[int, str]]:
        """The (band, flow) pairs whose next request would take the flow's tenant past its
        fair share of `capacity` (service tokens in flight, per band): see `allowances`;
        tenants share by weight, whatever number of flows (fairness ids) each sends. A band
        with one active tenant holds none; nor is a tenant that is the least served of the
        band's active tenants (its counter the lowest) and under its allowance: requests
        are whole, so an allowance of 1.5 of a tenant's requests would hold it at one (and
        one of 0.8 at none); while it is behind, the counter lets it round up by one
        request, and its service follows its share, not the rounding. With nothing in
        flight a tie for the lowest counter is enough (a joiner's counter is lifted)."""
        out: set[tuple[int, str]] = set()
        for band, queues in self.queues.items():
            running: dict[str, float] = {}
            for flow, service in self.in_flight.get(band, {}).items():
                owner = owner_of(flow)
                running[owner] = running.get(owner, 0.0) + service
            waiting = {owner_of(t) for t, q in queues.items() if q}
            active = set(running) | waiting
            if len(active) < 2:
                continue
            demands = {o: math.inf if o in waiting else running[o] for o in active}
            weights = {o: self.weights.get(o, 1.0) for o in active}
            allowed = allowances(capacity, weights, demands)
            for flow, queue in queues.items():
                owner = owner_of(flow)
                have = running.get(owner, 0.0)
                if not queue or have + queue[0].service <= allowed[owner]:
                    continue
                counter = self.vtc.get(owner, 0.0)
                others = [self.vtc.get(o, 0.0) for o in active if o != owner]
                if have <= 0 and all(counter <= c for c in others):
                    continue  # nothing in flight and the least served: it goes
                if 0 < have < allowed[owner] and all(counter < c for c in others):
                    continue  # the least served: behind its share, it may round up
                out.add((band, flow))
        return frozenset(out)

    def learn(self, candidates: list[Candidate]) -> None:
        """Learn each replica's slots: while its engine queues (waiting >= 1), the requests
        it runs are all it takes (vLLM's maxNumSeqs, or fewer when its KV cache is full)."""
        for c in candidates:
            if c.waiting is not None and c.waiting >= 1 and c.running:
                self.slots[c.url] = max(self.slots.get(c.url, 0.0), c.running)
        if len(self.slots) > MAX_FLOWS:
            self.slots = {c.url: self.slots[c.url] for c in candidates if c.url in self.slots}

    def charge(self, tenant: str, tokens: float, weight: float) -> None:
        """Add served tokens (prompt + 2 x output, or a correction) to the counters of flow
        `tenant`: its tenant's (divided by `weight`) and its own within its tenant."""
        owner = owner_of(tenant)
        self.vtc[owner] = self.vtc.get(owner, 0.0) + tokens / weight
        self.flow_vtc[tenant] = self.flow_vtc.get(tenant, 0.0) + tokens


def fair_capacity(
    settings: FlowSettings, flow: Flow, candidates: list[Candidate], cap: int | None = None
) -> float | None:
    """The service tokens in flight that one band's contending tenants share (`held`), None
    for no bound. `fair_in_flight_tokens` per replica when set; else derived from the pool:
    each replica's slots (learnt from its scrapes, `Flow.learn`; else the gateway's own
    cap per replica, `cap`; else the mean of the replicas learnt) x `FAIR_SLOTS` x the
    typical request's service (`Flow.typical`). So a fleet of `maxNumSeqs` 16 serving
    tenants of 200-, 2,000- and 8,000-token prompts with 100-token answers (a typical 400
    service tokens) lets 16 x 1.5 x 400 = 9,600 per replica be in flight while tenants
    contend: the 8,000-token tenant holds its share of that, not most of every engine
    step (bench/simulation/tenancy_sim.py chose the constants). Unknown (no slots learnt, no cap,
    nothing dispatched yet): no bound."""
    if not settings.fair_in_flight:
        return None
    if settings.fair_in_flight_tokens:
        return settings.fair_in_flight_tokens * len(candidates)
    typical = flow.typical()
    known = [flow.slots[c.url] for c in candidates if c.url in flow.slots]
    default = cap or (sum(known) / len(known) if known else None)
    if typical is None or default is None:
        return None
    slots = sum(flow.slots.get(c.url, default) for c in candidates)
    return FAIR_SLOTS * slots * typical


def owner_of(flow: str) -> str:
    """The tenant of a flow (`tenants.flow_id`: the tenant's name, or `name/fairness-id`)."""
    return flow.partition("/")[0]


def _lift(counters: dict[str, float], name: str, backlogged: list[float]) -> None:
    """VTC's rule for a joiner: its counter is at least the lowest of the backlogged."""
    if backlogged:
        counters[name] = max(counters.get(name, 0.0), min(backlogged))


def allowances(
    capacity: float, weights: Mapping[str, float], demands: Mapping[str, float]
) -> dict[str, float]:
    """Weighted max-min fair shares of `capacity` (water-filling): each flow gets at most
    its demand (`math.inf`: as much as it is given); what a flow asking less than its
    weighted share leaves is split among the others by weight. With every demand finite
    and their sum under `capacity`, every flow gets its demand."""
    share: dict[str, float] = {}
    left = capacity
    open_ = {t: w for t, w in weights.items() if w > 0}
    while open_:
        level = left / sum(open_.values())  # per unit of weight
        satisfied = {t for t, w in open_.items() if demands.get(t, math.inf) <= level * w}
        if not satisfied:
            for t, w in open_.items():
                share[t] = level * w
            return share
        for t in satisfied:
            share[t] = demands[t]
            left -= demands[t]
            del open_[t]
    return share


def below_line(
    candidate: Candidate,
    settings: FlowSettings,
    prefilling: int = 0,
    debt: float = 0.0,
    slots: float | None = None,
) -> bool:
    """Whether a low band may dispatch to `candidate`: no engine queue, KV usage under the
    lower line, load under `headroom_load` when set, else under (1 - `headroom_reserve`)
    of its learnt `slots` when known, else at most `LOW_RAMP` past what its last scrape
    saw (none: `LOW_RAMP` of the gateway's own): a replica whose slots are not learnt
    takes the low band a few per scrape until its engine queues and they are, instead of
    every waiting batch request between two scrapes (unknown figures count as below), with
    `hold_prefill` no high-band stream there awaiting its first token (`prefilling`), and
    its low-band prefill debt under the prefill budget drained (`debt`, `drained`; 0
    without a budget)."""
    if prefilling > 0 and settings.hold_prefill:
        return False
    if debt > 0:
        return False
    if candidate.waiting is not None and candidate.waiting >= 1:
        return False
    if candidate.kv_usage is not None and candidate.kv_usage >= settings.headroom_kv:
        return False
    limit = settings.headroom_load
    if limit is None and slots:
        limit = max(1.0, math.floor(slots * (1 - settings.headroom_reserve)))
    if limit is None:  # slots not learnt (the engine never queued): a few past the scrape
        limit = (candidate.running or 0.0) + (candidate.waiting or 0.0) + LOW_RAMP
    return candidate.load < limit


def drained(debt: float, elapsed: float, rate: float) -> float:
    """A replica's low-band prefill debt (tokens) after `elapsed` seconds at `rate`."""
    return max(0.0, debt - max(0.0, elapsed) * rate)


DEFAULT_OUTPUT_TOKENS = 256  # a request naming no max_tokens, of a tenant not seen answer more
# each answer of a tenant lowers its remembered largest output by this factor (half-life
# ~34 answers): a tenant whose answers grow long is counted at their length at once
OUTPUT_DECAY = 0.98


def expected_output_tokens(body: Mapping[str, Any] | None, observed: float | None = None) -> int:
    """The answer a request may have: its `max_completion_tokens` or `max_tokens`; without
    them its tenant's recent largest answer (`observed`, see `observed_output`), at least
    `DEFAULT_OUTPUT_TOKENS`: leaving `max_tokens` out does not make a request look cheap to
    the fair in-flight budget, which counts this until the request ends."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name) if body else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return max(DEFAULT_OUTPUT_TOKENS, math.ceil(observed or 0))


def observed_output(previous: float | None, completion: float) -> float:
    """A tenant's remembered largest output after an answer of `completion` tokens: a
    maximum that decays by `OUTPUT_DECAY` per answer."""
    return max(float(completion), (previous or 0.0) * OUTPUT_DECAY)


def estimate_prompt_tokens(body: Mapping[str, Any] | None) -> int:
    """About how many tokens a request's prompt has (token ids counted, text at 4 characters
    a token): charged to its tenant's counter when it dispatches, corrected by the answer's
    `usage` at its end."""
    if not body:
        return 0
    chars = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):  # strings, token ids, or lists of token ids
        chars += sum(len(p) if isinstance(p, str) else 4 * _ids(p) for p in prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(
                    len(part.get("text") or "") for part in content if isinstance(part, Mapping)
                )
    return max(1, chars // 4)


def _ids(item: object) -> int:
    """Token ids in one item of a prompt list: an id is one, a list of ids its length."""
    return len(item) if isinstance(item, list) else 1
