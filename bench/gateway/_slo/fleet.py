"""A discrete-event simulation of one gateway in front of simulated replicas, on a
simulated clock, routing with the gateway's own code.

Replicas are `kubellm.engine.sim_core.Engine`s (the simulator's pure core: paged KV,
prefix cache, token-budget scheduler, step times from a profile). kubellm's policies are
the shipped admission pass (`dispatch.admit_once` with the SLO gate, over candidates
built from the replicas' state; no fallback, and every request goes to a replica: no
replica counts as saturated) and the ticket's own feedback to the latency model, the SLO
gate's hooks (sent at dispatch, the first token, the whole answer: TTFT from dispatch
and the mean ITL). Engine figures are
scraped every `scrape_interval` simulated seconds (the gateway's default 1 s), the
gateway's own in-flight counts are exact, as in the gateway.

Two peers are modelled on vllm-router's published algorithms (not the Rust binary; see
bench/gateway/routing.py for the live one): `power_of_two` (two replicas at random, the
one with fewer requests outstanding) and `cache_aware` (the longest prefix match when it
covers at least half the prompt and loads are balanced, else the least loaded; loads
count as imbalanced when max - min > 32 and max > 1.1 x min, as its defaults say).
"""

from __future__ import annotations

import copy
import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kubellm.engine import sim_core
from kubellm.engine.sim_profiles import Profile
from kubellm.gateway.discovery.base import Endpoint, ModelTarget
from kubellm.gateway.routing.admission import CompletionRate, Route
from kubellm.gateway.routing.dispatch import WAKE_IN, Pass, admit_once
from kubellm.gateway.routing.gates.slo import SloGate
from kubellm.gateway.routing.replicas.load import LoadView
from kubellm.gateway.routing.replicas.outliers import OutlierDetector
from kubellm.gateway.routing.router import Router, routing_request
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.settings import Thresholds

from kubellm import api
from kubellm.simulation.gateway import NEVER_SATURATED

KUBELLM_POLICIES = ("prefix-aware", "least-load", "slo-aware", "round-robin")
PEER_POLICIES = ("power_of_two", "cache_aware")
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Job:
    """One request of a workload: when it arrives, its prompt text, its answer length."""

    arrival: float
    text: str
    max_tokens: int


@dataclass
class Outcome:
    job: Job
    replica: int
    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    predicted_ttft: float | None = None
    predicted_itl: float | None = None
    # what the SLO gate reads of a ticket: the request, its order, the gate's record of
    # the attempt (url, Dispatch, when sent, started), the replica that answers
    routing: RoutingRequest | None = None
    order: list[Candidate] = field(default_factory=list)
    dispatch: list[object] | None = None
    served: str | None = None
    target: ModelTarget | None = None
    stream = True
    # Fleet(present=N), every N-th request: the TTFT it would have had had nothing arrived
    # after it (the replica's exact state at dispatch, run forward on a copy): the most
    # any prediction made at dispatch can know
    present_ttft: float | None = None

    @property
    def timing(self) -> Outcome:  # the ticket's StreamTiming: first, mean_itl
        return self

    @property
    def chunks(self) -> int:  # the ticket's StreamTiming: events that carried text
        return self.tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.job.arrival

    @property
    def mean_itl(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


def tokens_of(text: str) -> list[int]:
    """Token ids of a prompt: one per 4 characters, the same text the same ids (so the
    engines' prefix cache sees what the gateway's prefix index sees)."""
    return [
        hash(text[i : i + CHARS_PER_TOKEN]) % 50_000 for i in range(0, len(text), CHARS_PER_TOKEN)
    ]


@dataclass
class Replica:
    engine: sim_core.Engine
    url: str
    busy: bool = False  # a step is scheduled
    in_flight: int = 0
    scraped: tuple[float, float, float] | None = None  # running, waiting, kv use


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    decisions: list[float] = field(default_factory=list)  # not filled here: see the bench


class Fleet:
    """Replicas on `profiles`, one policy, one seeded run of `jobs`."""

    def __init__(
        self,
        profiles: Sequence[Profile],
        policy: str,
        slo: api.SLO,
        *,
        seed: int = 0,
        scrape_interval: float = 1.0,
        changes: Sequence[tuple[float, int, Profile]] = (),
        present: int = 0,
        streamed: bool = True,
        thresholds: Thresholds = NEVER_SATURATED,
    ) -> None:
        self.replicas = [
            Replica(sim_core.Engine(p), f"http://replica-{i}") for i, p in enumerate(profiles)
        ]
        self.policy = policy
        self.slo = slo
        self.rng = random.Random(seed)
        self.scrape_interval = scrape_interval
        self.changes = sorted(changes)  # (time, replica, new profile): a replica slows down
        self.present = present
        # False: non-streamed requests, as the gateway sees them: no first token, nothing
        # learnt, their prefill counted ahead until the answer ends (Ticket._end_dispatch)
        self.streamed = streamed
        kubellm_policy = policy if policy in KUBELLM_POLICIES else "least-load"
        self.router = Router(LoadView(), OutlierDetector(10**9, 1.0), rng=random.Random(seed))
        self.now = 0.0
        self.router.predictions.clock = lambda: self.now
        self.target = ModelTarget(
            served_name="m",
            deployment="m",
            endpoints=tuple(Endpoint(r.url) for r in self.replicas),
            routing=api.Routing(policy=kubellm_policy),
            slo=slo,
        )
        self.outstanding = [0] * len(self.replicas)  # the peers' own counts
        self.gates = (SloGate(self.router.predictions, lambda t: ("m", "", "")),)
        # NEVER_SATURATED: every request goes to a replica at once. The gateway's defaults
        # (`Thresholds()`): a replica whose engine queues `max_waiting` or whose KV cache is
        # full is saturated; with every one saturated a request waits in the gateway (the
        # pass again when a step ends or WAKE_IN passes) until its TTFT budget is spent,
        # then it is refused (429: no fallback here), as `Scheduler._wait` does.
        self.thresholds = thresholds
        self.completions = CompletionRate(clock=lambda: self.now)

    # ------------------------------------------------------------ routing

    def _candidates(self) -> list[Candidate]:
        out = []
        for r in self.replicas:
            running, waiting, kv = r.scraped if r.scraped else (None, None, None)
            load = float(r.in_flight) if running is None else max(r.in_flight, running + waiting)
            out.append(Candidate(url=r.url, load=load, in_flight=r.in_flight, waiting=waiting,
                                 kv_usage=kv, running=running))  # fmt: skip
        return out

    def choose(
        self, request: RoutingRequest, p: Pass | None = None, position: int = 1
    ) -> tuple[int | None, list[Candidate]]:
        """The replica for `request` and the candidates it was chosen among; None: it
        waits (`p`, its admission pass, passes again later), -1: refused."""
        candidates = self._candidates()
        if self.policy == "power_of_two":
            a, b = self.rng.sample(range(len(self.replicas)), 2)
            return (a if self.outstanding[a] <= self.outstanding[b] else b), candidates
        if self.policy == "cache_aware":
            return self._cache_aware(request), candidates
        if p is None:
            p = self.admission(request)
        p.refresh(self.target, candidates, self.now, None, 0, position, True)
        decision = admit_once(p, self.gates, self.router)
        if decision is None:
            return None, candidates
        if decision.route is not Route.REPLICA:
            return -1, candidates
        order = decision.order
        urls = [r.url for r in self.replicas]
        return urls.index(order[0].url), candidates

    def admission(self, request: RoutingRequest) -> Pass:
        """A request's admission pass, begun now (its budget: the TTFT target)."""
        return Pass(self.target, request, self.now, self.now + self.slo.ttft_seconds, True,
                    self.thresholds, rate=self.completions.rate)  # fmt: skip

    def _cache_aware(self, request: RoutingRequest) -> int:
        loads = self.outstanding
        low, high = min(loads), max(loads)
        if high - low > 32 and high > 1.1 * low:
            return loads.index(low)
        hashes = request.chunk_hashes
        index = self.router.index
        matches = [index.matched(r.url, hashes) for r in self.replicas]
        best = max(range(len(matches)), key=lambda i: (matches[i], -loads[i]))
        if hashes and matches[best] / len(hashes) >= 0.5:
            return best
        return loads.index(low)

    # ------------------------------------------------------------ the run

    def run(self, jobs: Sequence[Job], on_decision: Callable[[], None] | None = None) -> Run:
        events: list[tuple[float, int, str, object]] = []
        seq = 0

        def push(t: float, kind: str, payload: object) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(events, (t, seq, kind, payload))

        for job in jobs:
            push(job.arrival, "arrive", job)
        for t, index, profile in self.changes:
            push(t, "change", (index, profile))
        end = jobs[-1].arrival if jobs else 0.0
        t = 0.0
        while t <= end + self.scrape_interval:
            push(t, "scrape", None)
            t += self.scrape_interval
        result = Run()
        step_end = [0.0] * len(self.replicas)  # when each replica's step in progress ends
        live: dict[str, Outcome] = {}
        predictions = self.router.predictions
        (slo,) = self.gates
        counter = 0
        # requests in the gateway's queue, in arrival order: (job, its request, its pass)
        waiting: list[tuple[Job, RoutingRequest, Pass | None]] = []

        def send(job: Job, request: RoutingRequest, index: int, order: list[Candidate]) -> None:
            nonlocal counter
            now = self.now
            if index < 0:  # refused: it never reaches a replica (a miss)
                result.outcomes.append(Outcome(job, -1, now))
                return
            replica = self.replicas[index]
            outcome = Outcome(job, index, now, routing=request, order=order,
                              served=replica.url, target=self.target)  # fmt: skip
            slo.sent(outcome, replica.url)  # type: ignore[arg-type]
            assert outcome.dispatch is not None
            predicted = predictions.model.predict(replica.url, outcome.dispatch[1])
            outcome.predicted_ttft, outcome.predicted_itl = predicted
            self.router.routed(request, replica.url, [r.url for r in self.replicas])
            counter += 1
            rid = f"r{counter}"
            live[rid] = outcome
            result.outcomes.append(outcome)
            replica.in_flight += 1
            self.outstanding[index] += 1
            replica.engine.add(
                sim_core.Request(rid, tokens_of(job.text), job.max_tokens, arrival=now)
            )
            if self.present and counter % self.present == 0:
                wait = step_end[index] - now if replica.busy else 0.0
                outcome.present_ttft = wait + _first_token_in(replica.engine, rid)
            if not replica.busy:
                replica.busy = True
                push(now, "step", index)

        def admit_waiting() -> None:
            """Each queued request's pass again, in order (`Scheduler._wait`)."""
            still = []
            for position, (job, request, p) in enumerate(waiting, 1):
                first = p is None
                if p is None:
                    p = self.admission(request)
                index, candidates = self.choose(request, p, position)
                if on_decision is not None:
                    on_decision()
                if index is None:
                    still.append((job, request, p))
                    if first:  # it passes again at least every WAKE_IN, and at its deadline
                        wake = p.now + WAKE_IN
                        while wake < p.deadline:
                            push(wake, "wake", None)
                            wake += WAKE_IN
                        push(p.deadline, "wake", None)
                else:
                    send(job, request, index, candidates)
            waiting[:] = still

        while events:
            now, _, kind, payload = heapq.heappop(events)
            self.now = now
            retry = False
            if kind == "scrape":
                for r in self.replicas:
                    e = r.engine
                    r.scraped = (float(len(e.running)), float(len(e.waiting)), e.kv_cache_usage())
            elif kind == "change":
                index, profile = payload  # type: ignore[misc]
                self.replicas[index].engine.profile = profile
            elif kind in ("arrive", "wake"):
                if kind == "arrive":
                    job: Job = payload  # type: ignore[assignment]
                    request = routing_request("m", {"prompt": job.text}, None)
                    waiting.append((job, request, None))
                retry = True
            elif kind == "step":  # a step starts: it runs until `done`
                index = payload  # type: ignore[assignment]
                step = self.replicas[index].engine.step()
                step_end[index] = now + step.duration
                push(now + step.duration, "done", (index, step))
            elif kind == "done":  # its tokens reach the gateway now
                index, step = payload  # type: ignore[misc]
                replica = self.replicas[index]
                for request_, _token in step.tokens:
                    outcome = live[request_.request_id]
                    if outcome.first is None:
                        outcome.first = now
                        if self.streamed:  # a whole answer's first token teaches nothing
                            slo.first_token(outcome, now)  # type: ignore[arg-type]
                    outcome.last = now
                    outcome.tokens += 1
                for request_ in step.finished:
                    outcome = live.pop(request_.request_id)
                    replica.in_flight -= 1
                    self.outstanding[index] -= 1
                    # every policy's answers train the model (its MAPE is reported for all);
                    # a whole (non-streamed) answer, as in the gateway, only ends its attempt
                    slo.over(outcome, learn=self.streamed)  # type: ignore[arg-type]
                    self.completions.record(replica.url)
                    retry = True
                if replica.engine.has_work:
                    push(now, "step", index)
                else:
                    replica.busy = False
            if kind == "scrape":
                retry = True
            if retry and waiting:
                admit_waiting()
        return result


def _first_token_in(engine: sim_core.Engine, request_id: str, max_steps: int = 100_000) -> float:
    """Seconds of steps until `request_id`'s first token on a copy of `engine`, with
    nothing else arriving (from the end of the step in progress)."""
    copy_ = copy.deepcopy(engine)
    elapsed = 0.0
    for _ in range(max_steps):
        step = copy_.step()
        elapsed += step.duration
        if any(r.request_id == request_id for r, _ in step.tokens):
            return elapsed
    return math.inf


# ------------------------------------------------------------------ workload


def workload(
    rate: float,
    count: int,
    seed: int,
    *,
    burstiness: float = 0.5,
    shared_share: float = 1 / 3,
    system_prompts: int = 4,
    prompt_median: int = 600,
    answer_median: int = 150,
    answer_max: int = 800,
) -> list[Job]:
    """`count` requests at `rate` per second: gamma inter-arrival times (shape
    `burstiness`, as vLLM's bench: under 1 burstier than Poisson), prompts heavy-tailed
    from 50 to 8,000 tokens (lognormal, median 600, clipped: the shape of Azure's 2023
    conversation trace's input column), answers 20-800 (median 150), a third of them
    after one of `system_prompts` shared system prompts of 1,000-2,000 tokens. The medians
    and the answers' bound are knobs for workloads the defaults were not tuned on."""
    rng = random.Random(seed)
    systems = [  # hex text: 2 characters per random byte
        rng.randbytes(rng.randint(1000, 2000) * CHARS_PER_TOKEN // 2).hex()
        for _ in range(system_prompts)
    ]
    jobs = []
    t = 0.0
    scale = 1.0 / (rate * burstiness)
    for i in range(count):
        t += rng.gammavariate(burstiness, scale)
        prompt = int(min(max(rng.lognormvariate(math.log(prompt_median), 1.1), 50), 8000))
        answer = int(min(max(rng.lognormvariate(math.log(answer_median), 0.9), 20), answer_max))
        unique = f"{i}:" + rng.randbytes(prompt * CHARS_PER_TOKEN // 2).hex()
        if rng.random() < shared_share:
            text = systems[rng.randrange(system_prompts)] + unique[: max(50, prompt // 4) * 4]
        else:
            text = unique
        jobs.append(Job(t, text, answer))
    # vLLM's bench rescales so that the last lands at count / rate
    stretch = (count / rate) / t if t > 0 else 1.0
    return [Job(j.arrival * stretch, j.text, j.max_tokens) for j in jobs]
