"""The adapter gate: only the replicas that hold a request's LoRA adapter may take it.

For a request naming an adapter, the pass keeps the candidates that have it registered
(`adapters.AdapterView`). When none has it, it is loaded on the least-loaded candidate
(`adapters.load_target`; the load already under way is joined, and a replica where a load
of it failed lately is skipped) and the pass waits for the load (`Pass.awaiting`) until its
deadline; when the expected load time does not fit before the deadline and the model has
a fallback, it does not wait (the load goes on, for the requests after it). No replica has
it and none will load it now (the load failed, or this front end cannot load): no waiting.

On a decision it counts where the request went (resident, loaded, fallback, refused) and
remembers the replica it goes to (the placement plan's recent use); a refusal while a load
is under way names the adapter loading (the 503's words).
"""

from __future__ import annotations

from typing import Any

from kubellm.gateway.routing.admission import Route
from kubellm.gateway.routing.dispatch import Decision, Gate, Pass
from kubellm.gateway.routing.replicas import adapters
from kubellm.gateway.routing.scorers.base import Candidate


class AdapterGate(Gate):
    def __init__(
        self,
        view: adapters.AdapterView,
        loads: adapters.AdapterLoads,
        metrics: adapters.AdapterMetrics,
        labels: Any,
    ) -> None:
        self.view = view
        self.loads = loads
        self.metrics = metrics
        self.labels = labels  # target -> its metric labels

    def narrow(self, p: Pass) -> None:
        name = p.routing.adapter
        if name is None or not p.candidates:
            return
        if p.waited:  # its load was awaited: who has it now
            p.waited, p.awaiting = False, None
            holders, loading = [c for c in p.candidates if self.view.has(c.url, name)], True
        else:
            holders, loading = self.holders(p, name)
            if p.awaiting is not None:
                p.loaded = True
                return
        p.loaded = p.loaded or loading
        kept = {c.url for c in holders}
        p.candidates, p.open = holders, [c for c in p.open if c.url in kept]
        if not holders and (self.loads.loader is None or (loading and self.loads.failed(name))):
            p.deadline = p.now  # none has it and none will load it now: no waiting

    def holders(self, p: Pass, name: str) -> tuple[list[Candidate], bool]:
        """The candidates that have adapter `name`, and whether a load was needed (a load
        to wait for is left in `p.awaiting`)."""
        candidates, target = p.candidates, p.target
        holders = [c for c in candidates if self.view.has(c.url, name)]
        ref = target.adapter(name)
        if holders or ref is None or self.loads.loader is None:
            return holders, False
        urls = {c.url for c in candidates}
        pending = [u for u in self.loads.pending(name) if u in urls]
        if pending:
            task = self.loads.start(pending[0], name, ref.path, self.labels(target))
        else:  # not where a load of it failed lately (retried after RETRY_FAILED_LOAD_S)
            fresh = [c for c in candidates if not self.loads.failed(name, c.url)]
            chosen = adapters.load_target(name, fresh)
            if chosen is None:
                return [], True
            task = self.loads.start(chosen.url, name, ref.path, self.labels(target))
        left = p.deadline - p.now
        if left <= 0 or (target.fallback and self.loads.expected_seconds > left):
            return [], True
        p.awaiting = task
        return [], True

    def decided(self, p: Pass, decision: Decision) -> Decision:
        name = p.routing.adapter
        if name is None:
            return decision
        route, order = decision.route, decision.order
        if route is Route.REPLICA and order:
            slots = self.view.slots(order[0].url, 1)  # vLLM reports max_lora
            self.view.sent(order[0].url, name, slots)
            kind = "loaded" if p.loaded else "resident"
        else:
            kind = "fallback" if route is Route.FALLBACK else "refused"
        self.metrics.requests.labels(*self.labels(p.target), name, kind).inc()
        if route is Route.REJECT and self.loads.pending(name):
            return Decision(route, decision.reason, order, name)
        return decision
