"""A concurrency-target policy in the style of Knative's KPA (`concurrency`).

Knative scales on in-flight requests per replica: desired =
ceil(total concurrency / target concurrency), scale-down after the largest
recommendation of a stable window (60 s) allows it. It knows nothing about
the KV-cache pool or replicas still loading weights: the comparison baseline
for the fleet simulation, and an example of a second registered policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kubellm.autoscaler import policy as p

from kubellm import api


@p.register("concurrency")
@dataclass(frozen=True)
class ConcurrencyPolicy:
    target_concurrency: float = 8.0  # running + waiting requests per replica
    stable_window_seconds: float = 60.0

    def decide(
        self, observation: p.Observation, state: p.PolicyState, spec: api.Autoscaling
    ) -> p.Decision:
        obs, now = observation, observation.now
        fresh = obs.fresh
        load = sum(r.running + r.waiting for r in fresh)
        pending = obs.gateway_pending or 0.0
        want = math.ceil((load + (pending if not fresh else 0.0)) / self.target_concurrency)
        floor = spec.min_replicas if spec.scale_to_zero else max(spec.min_replicas, 1)
        rec = min(max(want, floor, 1 if pending > 0 else 0), spec.max_replicas)
        if obs.stale or (obs.current_replicas and not obs.replicas):
            rec = max(rec, min(obs.current_replicas, spec.max_replicas))
        history = [
            (t, r) for t, r in state.recommendations if t >= now - self.stable_window_seconds
        ] + [(now, rec)]
        target = rec if rec >= obs.current_replicas else max(r for _, r in history)
        reason = (
            p.CONCURRENCY
            if target > obs.current_replicas
            else p.LOW_LOAD
            if target < obs.current_replicas
            else p.STEADY
        )
        return p.Decision(
            replicas=target,
            reason=reason,
            message=f"{reason}: concurrency {load:g} over target {self.target_concurrency:g}/"
            f"replica asks {want}; {obs.current_replicas} -> {target}",
            state=p.PolicyState(tuple(history), None),
            kv_cache_usage=(sum(r.kv_cache_usage for r in fresh) / len(fresh)) if fresh else None,
            queue_depth=(sum(r.waiting for r in fresh) / len(fresh)) if fresh else None,
        )
