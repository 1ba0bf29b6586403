"""The default policy (`kv-queue`): replicas from KV-cache occupancy and queue depth.

GPU utilisation reads near 100% whether a vLLM replica is comfortable or
drowning; what limits it is the KV-cache pool (every running request holds
KV blocks) and the queue that forms once the pool is full. So:

1. Signals, over the ready replicas whose metrics are fresh:
   - queue: `ceil(waiting / targetQueueDepth)` replicas, where `waiting` is
     the total of `vllm:num_requests_waiting` less the backlog the starting
     replicas will absorb once ready (each takes about as many requests as
     a ready replica runs now). Without that correction, a queue that grows
     while new pods load weights for minutes would ask for more and more
     pods: overshoot.
   - KV: `ceil(sum of kv_cache_usage / targetKVCacheUsage)` replicas.
   - request rate (only where `targetRequestsPerReplica` is set):
     `ceil(rate / targetRequestsPerReplica)` replicas, with the rate the
     larger of the gateway's arrival rate over 30 s and over the last period
     (smooth on the way down, at once on a step). KV usage and the queue read
     near zero until a replica is close to saturation, so at eight replicas
     carrying two replicas' worth they ask for one, and after the scale-down
     window the fleet would collapse, queue, and scale up again (flapping);
     the rate grows with load, so it holds the fleet at what the load needs.
     It also bounds the queue signal: the queue is backlog, not rate, and a
     backlog that grows while new pods load weights would ask for ever more.
     With the rate known the queue asks at most for the replicas that serve
     the arrivals and drain the (net) backlog within `DRAIN_SECONDS`.
   - forecast (only with `predictive`): `ceil(forecast / per-replica rate)`,
     the forecast being the arrival rate `modelLoadSeconds` ahead where it grew
     along a line over the last two model loads (`kubellm.autoscaler.forecast`);
     only above the rate signal's ask, and absorbed by the fallback as it is.
   Within a tolerance of 10% of the target a signal asks for no change
   (Kubernetes HPA's rule, against jitter).
2. Recommendation: the largest signal, at least `minReplicas` (at least one
   unless scale-to-zero is allowed *and* the deployment has been idle for
   `idleSecondsBeforeZero`), at least one while the gateway holds requests
   (wake-up from zero), at most `maxReplicas`. If any ready replica's
   metrics are stale, or any replica is still starting, the recommendation
   is at least the current count: unknown load never removes a replica, and
   a pod loading its model is never deleted for a queue it has not yet taken.
   (Since the rate ask is part of the maximum, no scale-down goes below it.)
3. Stabilisation (HPA's rule): scale up to the *smallest* recommendation of
   the last `scaleUpStabilizationSeconds`, scale down to the *largest* of the
   last `scaleDownStabilizationSeconds` (this period's included), so
   scale-down happens only when every recommendation in the window agrees. A
   fresh state is seeded with the current count, so a restart without state
   never scales down at once.
4. Step bounds per control period: up by at most max(4 pods, 100%), down by
   at most max(1 pod, 50%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kubellm.autoscaler import forecast
from kubellm.autoscaler import policy as p

from kubellm import api


@dataclass(frozen=True)
class Signals:
    """What the metrics ask for, with the figures behind it (for the message)."""

    waiting: float  # total waiting on fresh ready replicas
    absorbed: float  # of which starting replicas will take
    running: float
    kv_sum: float
    fresh: int
    want_queue: int
    want_kv: int
    rate: float | None = None  # requests/s arriving (None: the rate signal is off or unknown)
    want_rate: int = 0
    per_replica: float | None = None  # the rate signal's target, the spec's or derived
    derived: bool = False  # per_replica was derived from the learned rate
    floor: bool = False  # ... from the peak, nothing learned yet: it holds, it asks no growth
    forecast: float | None = None  # req/s one model load ahead (spec.predictive; None: no trend)
    want_forecast: int = 0

    @property
    def kv_mean(self) -> float | None:
        return self.kv_sum / self.fresh if self.fresh else None

    @property
    def queue_mean(self) -> float | None:
        return self.waiting / self.fresh if self.fresh else None


def _ask(load: float, target: float, current: int, tolerance: float) -> int:
    """Replicas that `load` (in target units summed over `current` replicas) asks for."""
    if current and abs(load / (current * target) - 1.0) <= tolerance:
        return current
    return math.ceil(load / target - 1e-9)


DRAIN_SECONDS = 60.0  # a queue-driven scale-up aims to drain the backlog within this
# Without targetRequestsPerReplica: this share of the learned rate (what one saturated
# replica answers per second), the headroom for spikes that arrive faster than a model loads.
DERIVED_HEADROOM = 0.8
LEARN_WEIGHT = 0.2  # moving average of the per-replica rate over saturated periods
LEARN_AFTER_SECONDS = 30.0  # saturated this long before answers measure a replica
# The cost rule leaves an overflow to the fallback only while the fallback serves fewer than
# this share of its maxConcurrency: past it, a growing overflow would queue at the gateway or
# be refused before a replica added now is ready.
FALLBACK_ROOM = 0.5


@p.register(p.DEFAULT_POLICY)
@dataclass(frozen=True)
class KVQueuePolicy:
    tolerance: float = 0.1
    scale_up_pods: int = 4
    scale_up_percent: float = 100.0
    scale_down_pods: int = 1
    scale_down_percent: float = 50.0

    def per_replica(
        self, spec: api.Autoscaling, learned: float | None, peak: float | None = None
    ) -> float | None:
        """The rate signal's requests/s per replica: the spec's, else derived from `learned`,
        else (nothing learned yet) from `peak`, the most one replica has answered over a
        period: a lower bound of its capacity, but a noisy one (a period's answers come in
        bursts), so with the same headroom; the fleet is not scaled below what carried the
        load so far."""
        if spec.target_requests_per_replica is not None:
            return spec.target_requests_per_replica
        if learned is None:
            return None if peak is None else peak * DERIVED_HEADROOM
        return learned * DERIVED_HEADROOM

    @staticmethod
    def learn(
        obs: p.Observation, spec: api.Autoscaling, state: p.PolicyState
    ) -> tuple[float | None, float | None]:
        """The learned per-replica rate and since when every replica has been saturated.

        Saturated: every fresh ready replica has a queue of at least its target,
        none is stale, and the replicas' answer rate is known. Once that has
        held for `LEARN_AFTER_SECONDS` (answers lag the load at first), this
        period's answers per replica are folded into a moving average.
        """
        fresh = obs.fresh
        saturated = (
            obs.replica_answer_rate is not None
            and bool(fresh)
            and not obs.stale
            and all(r.waiting >= spec.target_queue_depth for r in fresh)
        )
        learned = state.learned_rate
        if not saturated:
            return learned, None
        since = state.saturated_since if state.saturated_since is not None else obs.now
        assert obs.replica_answer_rate is not None
        sample = obs.replica_answer_rate / len(fresh)
        if obs.now - since >= LEARN_AFTER_SECONDS and sample > 0:
            learned = sample if learned is None else learned + LEARN_WEIGHT * (sample - learned)
        return learned, since

    @staticmethod
    def peak(obs: p.Observation, state: p.PolicyState) -> float | None:
        """The most requests/s one replica has answered in a period: the replicas' answers
        (at most the arrivals over 30 s, so a period's burst of answers does not count)
        over the fresh ready replicas, the largest seen; periods with stale metrics or
        starting replicas do not count."""
        peak, fresh = state.peak_rate, obs.fresh
        answered, arriving = obs.replica_answer_rate, obs.request_rate
        if answered is None or arriving is None or not fresh or obs.stale or obs.starting:
            return peak
        sample = min(answered, arriving) / len(fresh)
        return sample if peak is None or sample > peak else peak

    def signals(
        self,
        obs: p.Observation,
        spec: api.Autoscaling,
        learned: float | None = None,
        recent: bool = True,
        peak: float | None = None,
    ) -> Signals:
        """What each signal asks. `recent`: the rate is the larger of the 30 s rate and the
        last period's (False: the 30 s rate alone, where known)."""
        fresh = obs.fresh
        n = len(fresh)
        waiting = sum(r.waiting for r in fresh)
        running = sum(r.running for r in fresh)
        kv_sum = sum(r.kv_cache_usage for r in fresh)
        absorbed = min(waiting, obs.starting * running / n) if n else 0.0
        backlog = waiting - absorbed
        want_queue = _ask(backlog, spec.target_queue_depth, n, self.tolerance) if backlog > 0 else 0
        per_replica = self.per_replica(spec, learned, peak)
        floor = learned is None and spec.target_requests_per_replica is None
        rates = (obs.request_rate, obs.recent_request_rate)
        if not recent and obs.request_rate is not None:
            rates = (obs.request_rate,)
        known = [r for r in rates if r is not None]
        rate = max(known) if per_replica is not None and known else None
        want_rate = 0
        if rate is not None and per_replica is not None:
            want_rate = _ask(rate, per_replica, obs.current_replicas, self.tolerance)
            if floor:
                # the peak, a lower bound of a replica's capacity, holds the fleet up (no
                # scale-down below what carried the load), it asks for no growth
                want_rate = min(want_rate, obs.current_replicas)
            if backlog > 0:  # backlog in rate terms: serve the arrivals, drain it in a while
                drain = math.ceil((rate + backlog / DRAIN_SECONDS) / per_replica - 1e-9)
                want_queue = min(want_queue, max(drain, 1))
        predicted, want_forecast = None, 0
        if spec.predictive and per_replica is not None and rate is not None and not floor:
            predicted = forecast.trend(obs.admitted_history, obs.now, spec.model_load_seconds)
            if predicted is not None and predicted > rate:
                want_forecast = _ask(predicted, per_replica, obs.current_replicas, self.tolerance)
            else:
                predicted = None
        return Signals(
            waiting=waiting,
            absorbed=absorbed,
            running=running,
            kv_sum=kv_sum,
            fresh=n,
            want_queue=want_queue,
            want_kv=_ask(kv_sum, spec.target_kv_cache_usage, n, self.tolerance),
            rate=rate,
            want_rate=want_rate,
            per_replica=per_replica,
            derived=per_replica is not None and spec.target_requests_per_replica is None,
            floor=floor and per_replica is not None,
            forecast=predicted,
            want_forecast=want_forecast,
        )

    def decide(
        self, observation: p.Observation, state: p.PolicyState, spec: api.Autoscaling
    ) -> p.Decision:
        obs, now, current = observation, observation.now, observation.current_replicas
        learned, saturated_since = self.learn(obs, spec, state)
        peak = self.peak(obs, state)
        sig = self.signals(obs, spec, learned, peak=peak)
        pending = obs.gateway_pending
        unknown_load = obs.stale or (current > 0 and not obs.replicas)

        # Idle: every replica's load known and zero, and the gateway holds nothing.
        idle = (
            pending == 0
            and not unknown_load
            and sig.waiting == 0
            and sig.running == 0
            and (current == 0 or sig.fresh > 0)
        )
        idle_since = (state.idle_since if state.idle_since is not None else now) if idle else None

        # The floor: zero only where allowed, and after the idle period (or already at zero).
        idle_for = None if idle_since is None else now - idle_since
        may_be_zero = (
            spec.scale_to_zero
            and spec.min_replicas == 0
            and idle_for is not None
            and (current == 0 or idle_for >= spec.idle_seconds_before_zero)
        )
        floor = 0 if may_be_zero else max(spec.min_replicas, 1)
        if current == 0 and spec.scale_to_zero and spec.min_replicas == 0 and not pending:
            floor = 0  # at zero with no demand seen (or no gateway to see it): stay at zero

        # The recommendation and what drove it. With a fallback, the scale-down window
        # remembers the recommendation at the 30 s rate: the last period's rate may add
        # replicas at once (a step), but its noise, held for the window, would keep replicas
        # the load does not need, and the fallback takes what a 5 s burst brings.
        # With spec.fallbackCostRatio (the cost rule): the fallback takes an overflow until it
        # has lasted `overflow_wait` (nothing refused meanwhile), and the scale-down window
        # is `scale_down_hold`; without it, maxFallbackShare and the fixed window.
        ratio = spec.fallback_cost_ratio if obs.fallback_share is not None else None
        window = spec.scale_down_stabilization_seconds
        overflow_since, absorb = None, None
        if ratio is not None:
            window = scale_down_hold(ratio, spec.model_load_seconds, window)
            overflowing = current > 0 and max(sig.want_rate, sig.want_kv) > current
            if overflowing:
                overflow_since = state.overflow_since if state.overflow_since else now
            waited = now - overflow_since if overflow_since is not None else 0.0
            refused = obs.refused is not None and obs.refused > 0
            full = (
                obs.fallback_in_flight is not None
                and obs.fallback_capacity is not None
                and obs.fallback_in_flight >= FALLBACK_ROOM * obs.fallback_capacity
            )
            # the share rule's absorbing stands; the cost rule adds young overflows to it
            shared = (
                obs.fallback_share is not None and obs.fallback_share <= spec.max_fallback_share
            )
            absorb = shared or (
                not refused
                and not full
                and waited < overflow_wait(ratio, spec.model_load_seconds, window)
            )
        rec, driver, hold = self._recommend(sig, obs, spec, floor, unknown_load, absorb)
        remembered = rec
        if obs.fallback_share is not None and obs.request_rate is not None:
            smooth = self.signals(obs, spec, learned, recent=False, peak=peak)
            remembered = self._recommend(smooth, obs, spec, floor, unknown_load, absorb)[0]

        # Stabilisation windows over the remembered recommendations.
        earlier = state.recommendations or ((now, current),)
        up = min([rec, *(r for t, r in earlier if t > now - spec.scale_up_stabilization_seconds)])
        down = max(
            [
                remembered,
                *(r for t, r in earlier if t > now - window),
            ]
        )
        target = up if up > current else down if down < current else current
        # a scale-up is remembered as asked (the window holds it); otherwise the smooth ask
        history = [*earlier, (now, rec if target > current else remembered)]

        # Step bounds.
        limited = False
        if target > current:
            most = current + max(
                self.scale_up_pods, math.ceil(current * self.scale_up_percent / 100)
            )
            limited, target = target > most, min(target, most)
        elif target < current:
            fewest = current - max(
                self.scale_down_pods, math.floor(current * self.scale_down_percent / 100)
            )
            limited, target = target < fewest, max(target, fewest)
        if target > spec.max_replicas:  # maxReplicas lowered below the current count
            target, driver = spec.max_replicas, p.MAX_REPLICAS

        reason = self._reason(current, target, rec, driver, hold)
        message = self._message(sig, spec, pending, obs, rec, target, reason, limited)
        keep = max(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
        return p.Decision(
            replicas=target,
            reason=reason,
            message=message,
            state=p.PolicyState(
                _compact(history, now - keep),
                idle_since,
                learned,
                saturated_since,
                overflow_since,
                peak,
            ),
            kv_cache_usage=sig.kv_mean,
            queue_depth=sig.queue_mean,
        )

    @staticmethod
    def _recommend(
        sig: Signals,
        obs: p.Observation,
        spec: api.Autoscaling,
        floor: int,
        unknown_load: bool,
        absorb: bool | None = None,
    ) -> tuple[int, str, str | None]:
        """The recommendation for this period, what drove it, and what held it (if anything).

        `absorb`: the cost rule's answer to whether the fallback takes the overflow (None:
        the share rule decides)."""
        current, pending = obs.current_replicas, obs.gateway_pending
        candidates = [
            (sig.want_queue, p.QUEUE_DEPTH),
            (sig.want_kv, p.KV_CACHE_USAGE),
            (sig.want_rate, p.REQUEST_RATE),
            (sig.want_forecast, p.FORECAST),
            (1 if pending and pending > 0 else 0, p.GATEWAY_PENDING),
            (floor, p.MIN_REPLICAS),
        ]
        rec, driver = max(candidates, key=lambda c: c[0])
        # The fallback takes the overflow: load is a reason to add replicas only once the
        # fallback's share of the window's requests passes maxFallbackShare (sustained).
        absorbing = (
            obs.fallback_share is not None
            and current > 0
            and (obs.fallback_share <= spec.max_fallback_share if absorb is None else absorb)
        )
        floors = max(floor, 1 if pending and pending > 0 else 0)
        # A queue past its target is not absorbed: requests wait at the replicas, not at the
        # fallback, and latency is at risk. The rate and KV signals wait for the share.
        # A forecast is load too: while the fallback absorbs the overflow it waits with the
        # rate signal (growth the fallback takes cheaply needs no replica yet), and once the
        # overflow is the replicas' it asks for the load one model load ahead.
        held = max(current, floors, sig.want_queue)
        if absorbing and rec > held:
            rec, driver = (
                held,
                (p.QUEUE_DEPTH if held > max(current, floors) else p.FALLBACK_ABSORBING),
            )
        # Learning what a replica serves (the gateway readable, no rate given or learned yet):
        # the queue and KV signals add one replica a period, not a guess at the load.
        learning = (sig.per_replica is None or sig.floor) and obs.replica_answer_rate is not None
        if learning and driver in (p.QUEUE_DEPTH, p.KV_CACHE_USAGE) and rec > current + 1:
            rec = max(current + 1, floors)
        if rec > spec.max_replicas:
            rec, driver = spec.max_replicas, p.MAX_REPLICAS
        hold = (
            p.STALE_METRICS
            if obs.stale
            else p.REPLICAS_STARTING
            if unknown_load or obs.starting
            else None
        )
        if hold and rec < current:
            rec, driver = min(current, spec.max_replicas), hold
        elif not unknown_load:
            hold = None  # starting replicas held nothing back: the signals speak for themselves
        if driver == p.FALLBACK_ABSORBING and rec == current:
            hold = p.FALLBACK_ABSORBING

        return rec, driver, hold

    @staticmethod
    def _reason(current: int, target: int, rec: int, driver: str, hold: str | None) -> str:
        if target > current:
            return driver
        if target < current:
            if target == 0:
                return p.IDLE
            return p.MAX_REPLICAS if driver == p.MAX_REPLICAS else p.LOW_LOAD
        if rec > current:
            return p.SCALE_UP_STABILIZING
        if rec < current:
            return p.SCALE_DOWN_STABILIZING
        if hold:
            return hold
        return driver if driver in (p.MAX_REPLICAS, p.MIN_REPLICAS, p.GATEWAY_PENDING) else p.STEADY

    @staticmethod
    def _message(
        sig: Signals,
        spec: api.Autoscaling,
        pending: float | None,
        obs: p.Observation,
        rec: int,
        target: int,
        reason: str,
        limited: bool,
    ) -> str:
        parts = [f"{reason}: {obs.current_replicas} -> {target} replicas"]
        if sig.fresh:
            parts.append(
                f"queue {sig.waiting:g} waiting on {sig.fresh} ready "
                f"(target {spec.target_queue_depth:g}/replica"
                + (f", {sig.absorbed:g} for {obs.starting} starting" if sig.absorbed else "")
                + f") asks {sig.want_queue}"
            )
            parts.append(
                f"KV cache mean {sig.kv_mean:.2f} (target {spec.target_kv_cache_usage:.2f}) "
                f"asks {sig.want_kv}"
            )
        if sig.rate is not None and sig.per_replica is not None:
            source = " peak answered" if sig.floor else " derived" if sig.derived else ""
            parts.append(
                f"rate {sig.rate:.1f} req/s (target{source} {sig.per_replica:.3g}/replica) "
                f"asks {sig.want_rate}"
            )
        if sig.forecast is not None:
            parts.append(
                f"rate trend: {sig.forecast:.1f} req/s in {spec.model_load_seconds} s "
                f"asks {sig.want_forecast}"
            )
        if obs.fallback_share is not None:
            parts.append(
                f"fallback took {obs.fallback_share:.1%} of requests "
                f"(max {spec.max_fallback_share:.0%} before adding replicas)"
            )
        stale = sum(1 for r in obs.replicas if not r.fresh)
        if stale:
            parts.append(f"{stale} replica(s) with stale metrics: no scale-down")
        if obs.starting:
            parts.append(f"{obs.starting} starting")
        parts.append("gateway pending " + ("unknown" if pending is None else f"{pending:g}"))
        parts.append(f"recommendation {rec} (min {spec.min_replicas}, max {spec.max_replicas})")
        if limited:
            parts.append("step-limited")
        return "; ".join(parts)


def overflow_wait(ratio: float, load_seconds: float, hold_seconds: float) -> float:
    """How long an overflow the fallback takes must last before replicas are added for it.

    Rent or buy, per replica's worth of overflow, in replica-seconds (a replica's cost per
    second is 1, the fallback's for the same load `ratio`): the fallback costs `ratio` a
    second for as long as the overflow lasts; a replica added for it costs, once, the
    fallback's `ratio x load_seconds` while it loads and `hold_seconds` held after the
    overflow ends, and then 1 a second instead of `ratio`. Renting until the extra paid,
    `(ratio - 1) x t`, reaches that one-off cost (the deterministic ski-rental rule, never
    more than twice the cost of the best choice made knowing the overflow's length) gives
    `t = (ratio x load_seconds + hold_seconds) / (ratio - 1)`. At `ratio <= 1` the fallback
    is never dearer than a replica: the overflow never adds one (a queue or a refusal still
    does).
    """
    if ratio <= 1.0:
        return math.inf
    return (ratio * load_seconds + hold_seconds) / (ratio - 1.0)


def scale_down_hold(ratio: float, load_seconds: float, window: float) -> float:
    """How long a scale-down waits with the cost rule: what a mistake would cost.

    A replica removed for a dip that then comes back costs a model load again while the
    fallback takes its worth (`load_seconds x (1 + ratio)` replica-seconds); kept, it costs
    1 a second. Keep it (the window remembers its asks) for as long as that, at most
    `window` (scaleDownStabilizationSeconds): the deterministic ski-rental hold.
    """
    return min(float(window), load_seconds * (1.0 + ratio))


def _compact(history: list[tuple[float, int]], cutoff: float) -> tuple[tuple[float, int], ...]:
    """Drop entries older than the longest window, and earlier duplicates of the same value.

    An entry followed by a later one with the same replicas changes neither
    the minimum nor the maximum of any window that still holds the later one.
    """
    kept = [(t, r) for t, r in history if t > cutoff]
    return tuple(e for i, e in enumerate(kept) if i + 1 == len(kept) or kept[i + 1][1] != e[1])
