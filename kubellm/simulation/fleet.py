"""A discrete-event simulation of one LLMDeployment's fleet under an autoscaling policy.

Simulated clock only: nothing sleeps, nothing listens. The parts:

- replicas: each a `kubellm.engine.sim_core.Engine` (the simulated engine's
  pure model). A replica steps back to back while it has work; one step of
  `duration` simulated seconds emits its tokens at the step's end.
- lifecycle: a replica added by a scale-up is *starting* for `load_seconds`
  (pulling the image, loading weights: it holds a GPU but serves nothing),
  then *ready*. A scale-down removes starting replicas first (as a
  ReplicaSet does), then the newest ready ones, which *drain*: the gateway
  stops routing to them and they leave once their in-flight requests finish.
- routing: the gateway's own admission pass (`gateway.py`: production's
  `dispatch.admit_once` with the shipped router's least-load profile; no
  prefix-aware scoring, the traces share no prefixes). Without a fallback no
  replica counts as saturated, so every request is served by the fleet and a
  late scale-up shows as TTFT. With one (`FleetConfig.fallback`) the pass
  decides as in production: an unsaturated replica, a short wait in the
  gateway's queue, the fallback API (its modelled latency, at most
  maxConcurrency at once), or a refusal (the SLO missed). Engine load is read
  at the instant of the decision (production reads scrapes corrected by what
  it sent).
- the control loop: every `period` seconds it renders each ready replica's
  /metrics in vLLM's exposition format, parses it with the autoscaler's own
  `observe.engine_load`, builds the `Observation` the real loop builds
  (current replicas = the /scale value; starting = counted but not ready),
  renders the gateway's counters and pending gauge and turns them into the
  request rate, the fallback's share and the replicas' answer rate with the
  loop's own `observe` parsers, `rate.observe` and `overflow.observe`
  (samples kept in `status.autoscaler`; the loop's first sample is at t=0,
  before the load arrives), round-trips the policy state
  through `status.autoscaler` as the real loop does, calls the real policy's
  `decide()` and applies the replica count.

A request meets its SLO when its TTFT <= `slo.ttft_seconds` and its mean
inter-token latency (time per output token after the first) <=
`slo.itl_seconds`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kubellm import api, metrics
from kubellm.autoscaler import observe, overflow, rate
from kubellm.autoscaler import policy as p
from kubellm.engine.sim_core import BatchEngine, Engine, Request, StepResult
from kubellm.engine.sim_profiles import Profile

from . import gateway as gw
from .traces import Arrival

EPOCH = 1_800_000_000.0  # simulated t=0 as wall-clock seconds (the status stores RFC 3339)
STARTING, READY, DRAINING, GONE = "starting", "ready", "draining", "gone"
_STEP_END, _READY, _TICK, _FALLBACK_END, _RECHECK = 0, 1, 2, 3, 4  # event kinds, tie-break order


@dataclass
class SimRequest(Request):
    """A sim_core request that remembers when its first token came out."""

    first_token_at: float | None = None


@dataclass
class Replica:
    index: int
    engine: Engine
    state: str
    born: float
    ready_at: float
    gone_at: float | None = None
    busy: bool = False  # a step is in progress
    pending_step: StepResult | None = None  # its tokens land at the step's end

    @property
    def in_flight(self) -> int:
        return len(self.engine.waiting) + len(self.engine.running)


@dataclass
class Sample:
    """The fleet once per control period (for the plot and the time series in the JSON)."""

    time: float
    offered_rps: float  # arrivals in the last period / period
    ready: int
    starting: int
    draining: int
    desired: int
    waiting: int
    running: int
    kv_cache_usage: float  # mean over ready replicas
    ttft_p95: float | None  # of first tokens emitted in the last period
    fallback: int = 0  # requests the gateway sent to the fallback in the last period


@dataclass
class Result:
    trace: str
    policy: str
    duration: float
    requests: int = 0
    finished: int = 0
    met: int = 0
    ttft: list[float] = field(default_factory=list)
    missed: list[float] = field(default_factory=list)  # arrival times of requests missing the SLO
    itl: list[float] = field(default_factory=list)
    replica_seconds: float = 0.0
    decisions: list[tuple[float, int, int, str]] = field(default_factory=list)  # t, from, to, msg
    # (queue passed its target, scale-up decided or None): see Fleet._check_queue
    queue_episodes: list[tuple[float, float | None]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    max_replicas: int = 0
    fallback_requests: int = 0
    fallback_prompt_tokens: int = 0
    fallback_output_tokens: int = 0
    rejected: int = 0  # refused by the gateway (429/503): the SLO missed
    replica_answers: int = 0  # requests the replicas finished


@dataclass(frozen=True)
class FleetConfig:
    profile: Profile
    autoscaling: api.Autoscaling
    slo: api.SLO
    initial_replicas: int = 1
    load_seconds: float = 60.0
    period: float = 5.0
    drain_limit: float = 600.0  # simulated seconds after the trace to let requests finish
    # The gateway's admission and fallback (None: every request goes to the least-loaded
    # ready replica and queues there, no fallback).
    fallback: gw.ApiModel | None = None
    # Replicas decode in bulk (`sim_core.BatchEngine`: the same figures, a fraction of the
    # work); False: `Engine`, every request every step (tests compare the two).
    bulk: bool = True


def render_metrics(engine: Engine, model: str = "sim") -> str:
    """One replica's /metrics text, with vLLM's names, as the autoscaler would scrape it."""
    labels = f'{{model_name="{model}",engine="0"}}'
    return "".join(
        f"# TYPE {name} gauge\n{name}{labels} {value}\n"
        for name, value in (
            (metrics.NUM_REQUESTS_WAITING, len(engine.waiting)),
            (metrics.NUM_REQUESTS_RUNNING, len(engine.running)),
            (metrics.KV_CACHE_USAGE, engine.kv_cache_usage()),
        )
    )


def render_gateway_metrics(
    answered: int,
    pending: int,
    model: str = "sim",
    fallback: int = 0,
    rejected: int = 0,
    sent: int = 0,
) -> str:
    """The gateway's request counters and pending gauge for one deployment, as it exports
    them: answered by replicas, by the fallback (`fallback`) and refused (`rejected`), and
    sent to the fallback (`sent`, counted when sent)."""
    labels = f'model="{model}",deployment="sim",namespace="default"'
    counter = metrics.GATEWAY_REQUESTS
    return (
        f"# TYPE {counter.removesuffix('_total')} counter\n"
        f'{counter}{{{labels},target="replica",code="200"}} {answered}\n'
        f'{counter}{{{labels},target="fallback",code="200"}} {fallback}\n'
        f'{counter}{{{labels},target="none",code="429"}} {rejected}\n'
        f"# TYPE {metrics.GATEWAY_PENDING} gauge\n"
        f"{metrics.GATEWAY_PENDING}{{{labels}}} {pending}\n"
        f"# TYPE {metrics.GATEWAY_FALLBACK.removesuffix('_total')} counter\n"
        f'{metrics.GATEWAY_FALLBACK}{{{labels},reason="saturated"}} {sent}\n'
    )


class Fleet:
    """One run: a trace through a fleet under one policy (None: a fixed fleet)."""

    def __init__(
        self,
        config: FleetConfig,
        policy: p.Policy | None,
        arrivals: Sequence[Arrival],
        duration: float,
        trace: str = "",
        policy_name: str = "",
    ) -> None:
        self.config = config
        self.policy = policy
        self.arrivals = arrivals
        self.result = Result(trace, policy_name, duration, requests=len(arrivals))
        self.replicas: list[Replica] = []
        self.scale = config.initial_replicas  # the /scale subresource
        # status.autoscaler, as the real loop keeps it; the loop ran before the load arrived,
        # so the gateway's counters were sampled at t=0 (zero requests so far)
        self.status: dict[str, object] = {
            "requestSamples": rate.RateWindow().add(EPOCH, 0.0).to_status(),
            overflow.STATUS_KEY: overflow.GatewayWindow()
            .add(EPOCH, 0.0, 0.0, 0.0, config.autoscaling.scale_down_stabilization_seconds)
            .to_status(),
        }
        self.events: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._filler = [1] * 8192  # prompt body; token 0 is unique per request
        self._window_arrivals = 0
        self._window_ttft: list[float] = []
        self._samples: list[dict[str, object]] | None = None  # status.autoscaler.requestSamples
        self._queue_above = False
        self._open_episode: int | None = None
        self._gateway_samples: list[dict[str, object]] | None = None
        self._now = 0.0
        # The gateway (with a fallback only): its queue of (request index, deadline), the
        # fallback's requests in flight, and the production completion-rate window.
        self._queued: list[tuple[int, float]] = []
        self._fallback_in_flight = 0
        self._recheck_at: float | None = None
        self._completions = gw.CompletionRate(clock=lambda: self._now)
        fallback = config.fallback.target() if config.fallback else None
        self._gateway = gw.Gateway(config.slo, fallback)
        self._window_fallback = 0
        for _ in range(config.initial_replicas):
            self._add_replica(0.0, ready=True)

    # ------------------------------------------------------------------ events

    def _push(self, time: float, kind: int, replica: int = -1) -> None:
        self._seq += 1
        heapq.heappush(self.events, (time, kind, self._seq, replica))

    def run(self) -> Result:
        cfg, res = self.config, self.result
        self._push(cfg.period, _TICK)
        arrivals, n, i = self.arrivals, len(self.arrivals), 0
        end = res.duration + cfg.drain_limit
        while True:
            next_event = self.events[0][0] if self.events else math.inf
            if i < n and arrivals[i].time <= next_event:
                self._now = arrivals[i].time
                self._arrive(i, arrivals[i])
                i += 1
                continue
            if next_event > end:
                break  # the drain limit: requests still in flight count as missed
            now, kind, _, index = heapq.heappop(self.events)
            self._now = now
            if kind == _STEP_END:
                self._step_end(self.replicas[index], now)
            elif kind == _READY:
                self._ready(self.replicas[index], now)
            elif kind == _FALLBACK_END:
                self._fallback_in_flight -= 1
                self._admit_queued(now)
            elif kind == _RECHECK:
                self._recheck_at = None
                self._admit_queued(now)
            else:
                self._tick(now)
                if now + cfg.period <= res.duration:
                    self._push(now + cfg.period, _TICK)
        self._account(res.duration)
        return res

    # ------------------------------------------------------------------ requests

    def _arrive(self, index: int, arrival: Arrival) -> None:
        self._window_arrivals += 1
        if self.config.fallback is None and not any(r.state == READY for r in self.replicas):
            # only when scaled to zero; not modelled (min replicas >= 1 here)
            raise RuntimeError("no ready replica: scale-to-zero is not simulated")
        self._admit(index, arrival.time, None)

    def _to_replica(self, index: int, replica: Replica, now: float) -> None:
        arrival = self.arrivals[index]
        prompt = [index + 2, *self._filler[: arrival.prompt_tokens - 1]]
        replica.engine.add(
            SimRequest(f"r{index}", prompt, arrival.output_tokens, arrival=arrival.time)
        )
        if not replica.busy:
            self._start_step(replica, now)

    # ------------------------------------------------------------------ the gateway

    def _admit(self, index: int, now: float, deadline: float | None) -> bool:
        """One pass of the gateway's admission for one request (production's pass).
        `deadline` is None for a new request. True when it left the queue."""
        ready = [r for r in self.replicas if r.state == READY]
        candidates = [
            gw.Candidate(
                url=str(r.index),
                load=float(r.in_flight),
                in_flight=r.in_flight,
                waiting=float(len(r.engine.waiting)),
                kv_usage=r.engine.kv_cache_usage(),
                running=float(len(r.engine.running)),
            )
            for r in ready
        ]
        decision, deadline_ = self._gateway.admit(
            candidates, now, deadline, len(self._queued), self._fallback_in_flight,
            self._completions,
        )  # fmt: skip
        if decision is None:  # it waits in the gateway's queue
            if deadline is None:
                self._queued.append((index, deadline_))
                self._schedule_recheck(now)
            return False
        if decision.route is gw.Route.REPLICA:
            self._to_replica(index, self.replicas[int(decision.order[0].url)], now)
            if ready:
                self._check_queue(now, ready)
        elif decision.route is gw.Route.FALLBACK:
            self._to_fallback(index, now)
        else:  # REJECT: 429 (saturated) or 503 (no replica): the SLO is missed
            self.result.rejected += 1
            self.result.missed.append(self.arrivals[index].time)
        return True

    def _admit_queued(self, now: float) -> None:
        """Queued requests look again, oldest first (a slot freed, or time passed)."""
        if not self._queued:
            return
        for entry in list(self._queued):  # its position: every request still queued
            if self._admit(entry[0], now, entry[1]):
                self._queued.remove(entry)
        if self._queued:
            self._schedule_recheck(now)

    def _schedule_recheck(self, now: float) -> None:
        if self._recheck_at is None:
            self._recheck_at = now + gw.RECHECK_SECONDS
            self._push(self._recheck_at, _RECHECK)

    def _to_fallback(self, index: int, now: float) -> None:
        """The external API serves it: its modelled latency, its tokens billed."""
        api_model, res, slo = self.config.fallback, self.result, self.config.slo
        assert api_model is not None
        arrival = self.arrivals[index]
        res.fallback_requests += 1
        res.fallback_prompt_tokens += arrival.prompt_tokens
        res.fallback_output_tokens += arrival.output_tokens
        self._window_fallback += 1
        self._fallback_in_flight += 1
        self._push(now + api_model.duration(arrival.output_tokens), _FALLBACK_END)
        ttft = now - arrival.time + api_model.ttft_seconds
        res.finished += 1
        res.ttft.append(ttft)
        res.itl.append(api_model.itl_seconds)
        if ttft <= slo.ttft_seconds and api_model.itl_seconds <= slo.itl_seconds:
            res.met += 1
        else:
            res.missed.append(arrival.time)

    def _check_queue(self, now: float, ready: list[Replica]) -> None:
        """Track episodes of the mean queue on ready replicas above its target.

        An episode starts when an arrival pushes the queue past the target and
        ends at the first scale-up decision (resolved) or when an arrival finds
        the queue back under the target (a blip the policy rightly ignored).
        """
        waiting = sum(len(r.engine.waiting) for r in ready)
        above = waiting > self.config.autoscaling.target_queue_depth * len(ready)
        episodes = self.result.queue_episodes
        if above and not self._queue_above:
            episodes.append((now, None))
            self._open_episode = len(episodes) - 1
        elif not above:
            self._open_episode = None
        self._queue_above = above

    def _start_step(self, replica: Replica, now: float) -> None:
        result = replica.engine.step()
        if result.duration <= 0:  # nothing schedulable
            replica.busy = False
            return
        replica.busy = True
        replica.pending_step = result
        self._push(now + result.duration, _STEP_END, replica.index)

    def _step_end(self, replica: Replica, now: float) -> None:
        result = replica.pending_step
        assert result is not None, "a step ended that never started"
        replica.pending_step = None
        slo, res = self.config.slo, self.result
        for request, _ in result.tokens:  # every request here is a SimRequest (hot loop)
            if request.first_token_at is None:  # type: ignore[attr-defined]
                request.first_token_at = now  # type: ignore[attr-defined]
                self._window_ttft.append(now - request.arrival)
        for request in result.finished:
            assert isinstance(request, SimRequest) and request.first_token_at is not None
            ttft = request.first_token_at - request.arrival
            outputs = len(request.output)
            itl = (now - request.first_token_at) / (outputs - 1) if outputs > 1 else 0.0
            res.finished += 1
            res.replica_answers += 1
            res.ttft.append(ttft)
            res.itl.append(itl)
            if ttft <= slo.ttft_seconds and itl <= slo.itl_seconds:
                res.met += 1
            else:
                res.missed.append(request.arrival)
            if self.config.fallback is not None:
                self._completions.record(str(replica.index))
        if self._queued and result.finished:
            self._admit_queued(now)
        if replica.engine.has_work:
            self._start_step(replica, now)
        else:
            replica.busy = False
            if replica.state == DRAINING:
                replica.state, replica.gone_at = GONE, now

    # ------------------------------------------------------------------ lifecycle

    def _add_replica(self, now: float, ready: bool = False) -> None:
        load = 0.0 if ready else self.config.load_seconds
        replica = Replica(
            index=len(self.replicas),
            engine=BatchEngine(self.config.profile, token_ids=False)
            if self.config.bulk
            else Engine(self.config.profile),
            state=READY if ready else STARTING,
            born=now,
            ready_at=now + load,
        )
        self.replicas.append(replica)
        if not ready:
            self._push(now + load, _READY, replica.index)

    def _ready(self, replica: Replica, now: float) -> None:
        if replica.state == STARTING:
            replica.state = READY

    def _remove_replica(self, now: float) -> None:
        """Delete a starting replica if any (newest first), else drain the newest ready one."""
        for state in (STARTING, READY):
            live = [r for r in self.replicas if r.state == state]
            if live:
                victim = max(live, key=lambda r: r.born)
                if state == STARTING or not (victim.busy or victim.engine.has_work):
                    victim.state, victim.gone_at = GONE, now
                else:
                    victim.state = DRAINING
                return

    def _apply(self, now: float, replicas: int) -> None:
        while len(self._live()) < replicas:
            self._add_replica(now)
        while len(self._live()) > replicas:
            self._remove_replica(now)

    def _live(self) -> list[Replica]:
        """Replicas the /scale count covers: starting or ready (not draining)."""
        return [r for r in self.replicas if r.state in (STARTING, READY)]

    # ------------------------------------------------------------------ control loop

    def _observation(self, now: float) -> p.Observation:
        ready = [r for r in self.replicas if r.state == READY]
        scraped = tuple(
            observe.engine_load(render_metrics(r.engine), f"replica-{r.index}") for r in ready
        )
        # kubellm_gateway_pending_requests: admitted, not yet answered (draining replicas too,
        # the gateway's queue and the fallback's requests in flight)
        pending = sum(r.in_flight for r in self.replicas if r.state in (READY, DRAINING))
        pending += len(self._queued) + self._fallback_in_flight
        observation = p.Observation(
            now=EPOCH + now,
            current_replicas=self.scale,
            replicas=scraped,
            gateway_pending=float(pending),
        )
        res = self.result
        done_fallback = res.fallback_requests - self._fallback_in_flight
        text = render_gateway_metrics(
            res.replica_answers, pending, "sim", done_fallback, res.rejected, res.fallback_requests
        )
        names = ("sim", "sim", "default")
        window, counted = rate.observe(
            self.status, EPOCH + now, observe.gateway_admitted(text, *names)
        )
        self._samples = window.to_status()
        counts = (
            observe.gateway_admitted(text, *names),
            observe.gateway_fallback(text, *names),
            observe.gateway_answered(text, "sim", "replica", "sim", "default"),
            observe.gateway_answered(text, "sim", "none", "sim", "default"),
        )
        answers, _ = overflow.observe(
            self.status,
            EPOCH + now,
            counts,
            self.config.autoscaling.scale_down_stabilization_seconds,
        )
        self._gateway_samples = answers.to_status()
        return dataclasses.replace(
            observation,
            request_rate=window.rate if counted else None,
            recent_request_rate=window.recent if counted else None,
            fallback_share=answers.fallback_share if self.config.fallback else None,
            replica_answer_rate=answers.replica_rate,
            refused=answers.refused_recently if self.config.fallback else None,
            # sent less answered, from the counters, as the loop reads it
            fallback_in_flight=max(
                0.0,
                observe.gateway_fallback(text, *names)
                - observe.gateway_answered(text, "sim", "fallback", "sim", "default"),
            )
            if self.config.fallback
            else None,
            fallback_capacity=self.config.fallback.max_concurrency
            if self.config.fallback
            else None,
            admitted_history=tuple((t, a) for t, a, *_ in answers.samples),
        )

    def _tick(self, now: float) -> None:
        res, cfg = self.result, self.config
        if self.policy is not None:
            observation = self._observation(now)
            state = p.PolicyState.from_status(self.status)
            decision = self.policy.decide(observation, state, cfg.autoscaling)
            self.status = {
                **decision.state.to_status(),
                "requestSamples": self._samples,
                overflow.STATUS_KEY: self._gateway_samples,
            }
            if decision.replicas != self.scale:
                res.decisions.append((now, self.scale, decision.replicas, decision.message))
                if decision.replicas > self.scale:
                    self._close_episodes(now)
                self.scale = decision.replicas
                self._apply(now, self.scale)
        self._sample(now)

    def _close_episodes(self, now: float) -> None:
        """A scale-up decision resolves the episode in progress, if any."""
        if self._open_episode is not None:
            start, _ = self.result.queue_episodes[self._open_episode]
            self.result.queue_episodes[self._open_episode] = (start, now)
            self._open_episode = None

    def _sample(self, now: float) -> None:
        cfg, res = self.config, self.result
        by_state = {STARTING: 0, READY: 0, DRAINING: 0}
        waiting = running = 0
        kv = 0.0
        for r in self.replicas:
            if r.state in by_state:
                by_state[r.state] += 1
            if r.state in (READY, DRAINING):
                waiting += len(r.engine.waiting)
                running += len(r.engine.running)
            if r.state == READY:
                kv += r.engine.kv_cache_usage()
        ttft = sorted(self._window_ttft)
        res.samples.append(
            Sample(
                time=now,
                offered_rps=self._window_arrivals / cfg.period,
                ready=by_state[READY],
                starting=by_state[STARTING],
                draining=by_state[DRAINING],
                desired=self.scale,
                waiting=waiting,
                running=running,
                kv_cache_usage=kv / by_state[READY] if by_state[READY] else 0.0,
                ttft_p95=ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))] if ttft else None,
                fallback=self._window_fallback,
            )
        )
        self._window_fallback = 0
        res.max_replicas = max(res.max_replicas, by_state[READY] + by_state[STARTING])
        self._window_arrivals = 0
        self._window_ttft = []

    def _account(self, until: float) -> None:
        """Replica-seconds over [0, until]: every replica holding a GPU (starting to draining)."""
        total = 0.0
        for r in self.replicas:
            stop = until if r.gone_at is None else min(r.gone_at, until)
            total += max(0.0, stop - r.born)
        self.result.replica_seconds = total
