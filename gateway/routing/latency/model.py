"""Each replica's TTFT and ITL, predicted from its state at dispatch and learnt online.

Pure: no clock, no I/O. The routing core records a `Dispatch` when it sends a request to
a replica (the replica's state then, and the request's prompt), feeds the TTFT when the
first token streams and the ITL when the whole answer has (`ReplicaModel.learn`).
`predict` answers for a candidate request before it is sent.

The model is the engine's own physics, shared by every replica, times two speed factors
per replica, learnt online: `k_step` for what a step costs, `k_prefill` for what a prompt
token costs. One engine step costs a fixed part (the weights streamed once,
`step_base_s`), a part per sequence decoding in the batch (its KV read, `decode_token_s`)
and a part per prompt token computed (`prefill_token_s`); a step computes at most
`max_num_batched_tokens` prompt tokens. So, for a request whose prompt leaves `u` tokens
uncached on the replica (a prefix it holds enters only here), with `a` prompt tokens
ahead of it (prompts this gateway sent there that have not begun to stream, less what
the replica has computed of them since the first of them began: `drained`), a batch of
`b` sequences and `o` requests there that other gateways sent (the engine's queue beyond
this gateway's, bounded by its whole count beyond this gateway's in flight):

    steps = 1 + (u + a) // max_num_batched_tokens
    TTFT  = k_step    x [(steps + 1/2) x (base + decode x b) + o x base]
          + k_prefill x prefill x (u + a + o x QUEUED_PROMPT_TOKENS)
    ITL   = k_step x (base + decode x b) / (1 - busy)
          + k_prefill x prefill x a / PRIOR_ANSWER_TOKENS
    busy  = k_prefill x prefill x r                  (at most BUSY_MAX)

where `r` is the rate of prompt tokens this gateway has been sending the replica (a
moving mean over ~`PREFILL_RATE_WINDOW_S`): `busy` is the share of the replica's time
spent computing prompts, which stalls every decoding stream there for as long. A
request's own prefill adds to the others' `r` (`others_itl`), so a long prompt is not
sent where it would push the streams already there past the ITL target. (The half step:
a request arrives mid-step on average and waits for it to end.)

Learning: each observed TTFT or ITL moves log k_step and log k_prefill by RATE x
log(observed / predicted), shared between them as their parts make up the prediction (a
short prompt's TTFT is mostly steps, a long one's mostly prefill, an ITL mostly steps),
so a card that computes prompts 3.2x slower but steps 1.6x slower (an A100 against the
H100 prior) is learnt as such; one factor per figure could not hold both. An answer's
weight halves after ~34 later ones; 0 (factor 1) until data arrive: the prior is the
profile's step costs (`Prior`, or `Prior.from_capacity` from `status.capacity`'s decode
bound). The TTFT is learnt at the first token: learnt with the whole answer, seconds
later, a replica flooded before its first answer ended was predicted at the prior all
that time (on 2 H100 + 2 A100 at 70/s the A100s' first answers came 15 s in); a
stream that then breaks has it taken back and its break learnt as a late answer
(`failed`): only answers that end whole teach the model (a replica that sent one token
at once and dropped the connection was learnt as the fastest and took 38 of 40 requests). A replica
that slows down shows growing factors within tens of answers, and its speed factor
against its peers is what `kubellm diagnose` reports. A free regression per replica was
tried first (recursive least squares over the same features): in the bench it predicted
TTFT with a mean error of 40-100% (its weights swung on the noisy, lagging engine
figures).

Stale engine metrics are unknown, never trusted: without fresh figures the batch is
the gateway's own in-flight count (a lower bound) and no other gateway's requests count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

# Weight of each answer in the speed factors' moving mean (half-life ln 0.5 / ln(1 -
# RATE) ~ 34 answers). Measured in bench/gateway/slo_routing.py (60 s per case, at each pool's
# knee: share within the SLO, TTFT MAPE): 0.05 gave 4 H100 at 80/s 92.1% / 32.8%, mixed
# at 55/s 92.2% / 28.2%, slow at 70/s 95.2% / 30.3%; 0.02 gave 93.9% / 26.2%, 91.7% /
# 25.0%, 96.9% / 24.1%. A TTFT's error is skewed (a burst sent after a request joins its
# step, unknowable at dispatch, and delays it 2-5x), so a fast mean swings the factors
# with each burst (on 4 H100s whose prior is exact, to 1.2-2x) and over-predicts the
# calm answers after it; with the factors held at 1 there the error was 21%.
RATE = 0.02
# Predictions never go under this (seconds).
FLOOR_S = 1e-4
# The reference state at which replicas' speeds are compared (speed_factors): a
# 1,000-token uncached prompt joining a batch of 8, nothing ahead.
REFERENCE_TOKENS = 1000
REFERENCE_BATCH = 8
# Answers a replica needs before its speed factor is reported.
MIN_SAMPLES_FOR_SPEED = 20
# A request another gateway sent is costed as one step plus this many prompt tokens.
QUEUED_PROMPT_TOKENS = 250
# ITL: tokens ahead are spread over this many decode steps of the new answer.
PRIOR_ANSWER_TOKENS = 100
# A request whose best replica's SLO cost (slo_cost) is above this is out of reach: it goes
# to the replica already worst off (slo_scores). Over 1, since the ITL is over-predicted
# near the knee (median 1.2-1.4x at 80-100 req/s on 4 H100): tried in bench/gateway/slo_routing.py
# at 1.0 / 1.25 / 1.5, share within the SLO on 4 H100 at 100/s 90.8 / 93.8 / 96.9%, on the
# slow pool at 100/s 78.5 / 84.3 / 87.2%, on the mixed pool at 70/s 79.5 / 84.8 / 83.8%.
OUT_OF_REACH = 1.5
# The share of time a replica may be predicted to spend on prompts (1 would be a stall).
BUSY_MAX = 0.9
# The window of the prompt-token rate per replica (predicted.Predictions), seconds.
PREFILL_RATE_WINDOW_S = 5.0
# Without answers, a replica's factors halve (in log) toward the prior every this many
# seconds (ReplicaModel.fade).
IDLE_HALF_LIFE_S = 60.0
# The decode bounds (tokens/s of one stream) a prior is derived from: a status or a file
# that says 1e-300 would make every prediction astronomic (every request out of reach, or
# sent to the fallback at once); outside this range the default prior is kept.
DECODE_BOUND_RANGE = (1.0, 1e6)
# An engine's request count above this is not believed (`_count`).
MAX_COUNT = 1e6
# One answer moves log k by at most this (a stalled stream must not swing the factor).
MAX_LOG_STEP = math.log(4.0)


@dataclass(frozen=True)
class Prior:
    """The engine's step costs before any answer is seen (the simulator profile's
    figures; defaults: Llama 3.1 8B on one H100, engine_image/sim_profiles.py)."""

    step_base_s: float = 0.007
    prefill_token_s: float = 32e-6
    decode_token_s: float = 80e-6
    max_num_batched_tokens: int = 8192

    @classmethod
    def from_capacity(cls, decode_tokens_per_second_bound: float) -> Prior:
        """From `status.capacity.decodeTokensPerSecondBound` (one stream's bandwidth
        bound): a step at ~70% of the bound, prefill per token 1/220 of a step and a
        sequence's KV read 1/90 of one (the H100 8B profile's ratios; learnt afterwards)."""
        low, high = DECODE_BOUND_RANGE
        if not low <= decode_tokens_per_second_bound <= high:
            raise ValueError(
                "status.capacity.decodeTokensPerSecondBound must be between "
                f"{low:g} and {high:g} tokens/s, not {decode_tokens_per_second_bound!r}"
            )
        step = 1.0 / (0.7 * decode_tokens_per_second_bound)
        return cls(step_base_s=step, prefill_token_s=step / 220, decode_token_s=step / 90)

    def ttft(self, d: Dispatch) -> float:
        """The physics' TTFT of dispatch `d` (speed factor 1)."""
        tokens = d.uncached + d.ahead_tokens
        steps = 1 + tokens // self.max_num_batched_tokens
        step = self.step_base_s + self.decode_token_s * d.batch
        queued = self.step_base_s + self.prefill_token_s * QUEUED_PROMPT_TOKENS
        wait = (steps + 0.5 + slot_steps(d)) * step
        return wait + self.prefill_token_s * tokens + d.others * queued

    def itl(self, d: Dispatch, busy: float = 0.0) -> float:
        """The physics' mean ITL of dispatch `d` (speed factor 1) on a replica that spends
        `busy` of its time computing prompts."""
        spread = self.prefill_token_s * d.ahead_tokens / PRIOR_ANSWER_TOKENS
        step = self.step_base_s + self.decode_token_s * d.batch
        return step / (1.0 - min(max(busy, 0.0), BUSY_MAX)) + spread


class Dispatch(NamedTuple):
    """A replica's state when a request was (or would be) sent there, and the request.
    (A tuple, not a frozen dataclass: one is built per attempt, and a frozen dataclass
    costs four times as much to build.)"""

    prompt_tokens: int
    cached_tokens: int = 0  # the part of the prompt the replica holds (prefix index)
    ahead_tokens: int = 0  # prefill this gateway sent there that has not begun to stream
    ahead_requests: int = 0  # ... and how many requests that is
    prefill_rate: float = 0.0  # uncached prompt tokens/s sent there lately, this one not
    in_flight: int = 0  # this gateway's requests there
    running: float | None = None  # the engine's figures; None: stale or never scraped
    waiting: float | None = None
    slots: float = 0.0  # the replica's concurrency limit as seen (0: never seen full)
    answer_tokens: float = 0.0  # the answers' mean length lately (tokens)

    @property
    def uncached(self) -> int:
        return max(self.prompt_tokens - self.cached_tokens, 0)

    @property
    def batch(self) -> float:
        """Sequences it would decode with: the engine's running ones or this gateway's in
        flight there, whichever is more (scraped figures lag by up to a scrape), plus itself;
        at most the replica's concurrency limit where it is known (the rest wait for a
        slot: `queued`)."""
        batch = max(_count(self.running), float(self.in_flight)) + 1.0
        return min(batch, self.slots) if self.slots >= 1 else batch

    @property
    def queued(self) -> float:
        """Answers that must end before this request gets a slot on a replica whose
        concurrency limit is known (`max_num_seqs`, or what its KV cache holds): this
        gateway's requests there beyond the limit, itself included (0 while one is free)."""
        if self.slots < 1:
            return 0.0
        return max(float(self.in_flight) + 1.0 - self.slots, 0.0)

    @property
    def others(self) -> float:
        """Queued requests there that this gateway did not send (other gateways'): the
        engine's queue beyond this gateway's prompts not yet streaming; 0 when unknown.
        (Others' running requests are in `batch`: they cost a decode, not a queue slot.)"""
        waiting = _count(self.waiting)
        queued = waiting - self.ahead_requests
        if queued <= 0:
            return 0.0
        running = _count(self.running)
        # the engine's whole count against this gateway's: a scrape up to a second old
        # splits this gateway's requests between running and waiting as they were then,
        # but their sum moves only as requests arrive and finish
        return min(queued, max(running + waiting - self.in_flight, 0.0))


def slot_steps(d: Dispatch) -> float:
    """Decode steps until a slot frees for `d` on a full replica: `queued` answers must end
    first, and with `slots` answers of `answer_tokens` sharing the replica one ends every
    answer_tokens / slots steps (0 while a slot is free). Without it a replica at its
    `max_num_seqs` was predicted to start a request in 20-70 ms that waited 1.2-1.9 s for
    a slot (bench/gateway/slo_routing.py, pool `2fast2slow`)."""
    queued = d.queued
    if not queued:
        return 0.0
    return queued * d.answer_tokens / d.slots


def _count(figure: float | None) -> float:
    """An engine's request count as the model uses it: 0 when unknown or unusable (None,
    NaN, negative or past MAX_COUNT; the scrape parser already refuses these, and the
    model must not raise whatever a replica says)."""
    if figure is None or not 0.0 <= figure <= MAX_COUNT:
        return 0.0
    return figure


REFERENCE = Dispatch(prompt_tokens=REFERENCE_TOKENS, in_flight=REFERENCE_BATCH - 1)


class ReplicaModel:
    """One replica's two speed factors, as moving means of log(observed / predicted):
    `step` scales the per-step part (weights streamed, each sequence's KV read) and
    `prefill` the per-prompt-token part. Each answer's error in log is shared between
    them as their parts make up its prediction (a short prompt's TTFT is mostly steps, a
    long one's mostly prefill; an ITL is mostly steps), so a card that computes prompts
    3.2x slower but decodes 1.6x slower (A100 against H100) is learnt as such."""

    __slots__ = ("log_prefill", "log_step", "prior", "rate", "samples")

    def __init__(self, prior: Prior, rate: float = RATE) -> None:
        self.prior = prior
        self.rate = rate
        self.log_step = 0.0
        self.log_prefill = 0.0
        self.samples = 0

    @property
    def speed(self) -> tuple[float, float]:
        """(per-step, per-prompt-token) factors against the prior's physics (1.5: 50%
        slower)."""
        return math.exp(self.log_step), math.exp(self.log_prefill)

    def fade(self, idle_seconds: float) -> None:
        """No answer for `idle_seconds`: the factors drift back toward the prior (half-life
        IDLE_HALF_LIFE_S), so a replica routed around because it was slow is tried again
        once it may have recovered, and relearnt from its next answers."""
        keep = 0.5 ** (max(idle_seconds, 0.0) / IDLE_HALF_LIFE_S)
        self.log_step *= keep
        self.log_prefill *= keep

    def busy(self, prefill_rate: float) -> float:
        """The share of its time this replica spends on prompts at `prefill_rate` tokens/s."""
        return math.exp(self.log_prefill) * self.prior.prefill_token_s * prefill_rate

    def _parts(self, d: Dispatch) -> tuple[float, float, float, float]:
        """(TTFT's step part, its prefill part, ITL's step part, its prefill part), each
        with its factor applied."""
        prior = self.prior
        k_step, k_prefill = math.exp(self.log_step), math.exp(self.log_prefill)
        tokens = d.uncached + d.ahead_tokens
        steps = 1 + tokens // prior.max_num_batched_tokens
        step = prior.step_base_s + prior.decode_token_s * d.batch
        others = d.others
        ttft_step = k_step * ((steps + 0.5 + slot_steps(d)) * step + others * prior.step_base_s)
        ttft_prefill = k_prefill * prior.prefill_token_s * (tokens + others * QUEUED_PROMPT_TOKENS)
        busy = min(max(k_prefill * prior.prefill_token_s * d.prefill_rate, 0.0), BUSY_MAX)
        itl_step = k_step * step / (1.0 - busy)
        itl_prefill = k_prefill * prior.prefill_token_s * d.ahead_tokens / PRIOR_ANSWER_TOKENS
        return ttft_step, ttft_prefill, itl_step, itl_prefill

    def drained(self, seconds: float, running: float | None, in_flight: int) -> float:
        """Prompt tokens this replica computes in `seconds` of steps full of prompts
        (`max_num_batched_tokens` each) beside a batch of `running` (or `in_flight`)."""
        prior = self.prior
        batch = max(_count(running), float(in_flight))
        step = math.exp(self.log_step) * (prior.step_base_s + prior.decode_token_s * batch)
        tokens = prior.max_num_batched_tokens
        return (
            seconds * tokens / (step + math.exp(self.log_prefill) * prior.prefill_token_s * tokens)
        )

    def predict(self, dispatch: Dispatch) -> tuple[float, float]:
        """(TTFT, ITL) in seconds."""
        ttft_step, ttft_prefill, itl_step, itl_prefill = self._parts(dispatch)
        return max(ttft_step + ttft_prefill, FLOOR_S), max(itl_step + itl_prefill, FLOOR_S)

    def others_itl(self, dispatch: Dispatch) -> float:
        """The mean ITL the requests already there would see once this one's prompt adds
        to the replica's prompt rate (its tokens over the rate's window); 0 when nobody is
        there."""
        if dispatch.batch <= 1:
            return 0.0
        prior = self.prior
        rate = dispatch.prefill_rate + dispatch.uncached / PREFILL_RATE_WINDOW_S
        busy = min(self.busy(rate), BUSY_MAX)
        step = prior.step_base_s + prior.decode_token_s * dispatch.batch
        spread = prior.prefill_token_s * dispatch.ahead_tokens / PRIOR_ANSWER_TOKENS
        return math.exp(self.log_step) * step / (1.0 - busy) + math.exp(self.log_prefill) * spread

    def observe(self, dispatch: Dispatch, ttft: float | None, itl: float | None) -> None:
        """Learn from one answer (either figure None, not finite or not positive: that
        part is skipped)."""
        self.learn(dispatch, ttft, itl)

    def learn(
        self, dispatch: Dispatch, ttft: float | None, itl: float | None, answer: bool = True
    ) -> tuple[float, float]:
        """What `predict` said of `dispatch` before this answer, then learn from it as
        `observe` does (one pass over the physics for both: the ticket calls this once
        per streamed answer). `answer` False: a first token, not yet an answer (not
        counted in `samples`)."""
        ttft_step, ttft_prefill, itl_step, itl_prefill = self._parts(dispatch)
        predicted = max(ttft_step + ttft_prefill, FLOOR_S), max(itl_step + itl_prefill, FLOOR_S)
        rate = self.rate
        if ttft is not None and math.isfinite(ttft) and ttft > 0:
            error = _error(ttft / (ttft_step + ttft_prefill))
            share = ttft_step / (ttft_step + ttft_prefill)
            self.log_step += rate * error * share
            self.log_prefill += rate * error * (1.0 - share)
        if itl is not None and math.isfinite(itl) and itl > 0:
            error = _error(itl / (itl_step + itl_prefill))
            share = itl_step / (itl_step + itl_prefill)
            self.log_step += rate * error * share
            self.log_prefill += rate * error * (1.0 - share)
        if answer:
            self.samples += 1
        return predicted

    def failed(self, dispatch: Dispatch) -> None:
        """An answer that broke off after it began: learnt as a TTFT as late as one answer
        may say (MAX_LOG_STEP over the prediction), so a replica that breaks its streams
        never looks faster for it (a stream broken after one instant token is not a fast
        answer)."""
        ttft_step, ttft_prefill, _, _ = self._parts(dispatch)
        share = ttft_step / (ttft_step + ttft_prefill)
        self.log_step += self.rate * MAX_LOG_STEP * share
        self.log_prefill += self.rate * MAX_LOG_STEP * (1.0 - share)

    def unlearn(self, step: float, prefill: float) -> None:
        """Take back what one figure moved the factors by (`learn`'s change in log)."""
        self.log_step -= step
        self.log_prefill -= prefill


def _error(ratio: float) -> float:
    """How far one answer pulls the factors (in log): log(ratio), at most MAX_LOG_STEP."""
    return min(max(math.log(ratio), -MAX_LOG_STEP), MAX_LOG_STEP)


class LatencyModel:
    """Every replica's model, by URL; replicas first seen start from their own prior
    (`priors`: its model's status.capacity, its simulator profile) or the default."""

    def __init__(self, prior: Prior | None = None, rate: float = RATE) -> None:
        self.prior = prior or Prior()
        self.rate = rate
        self.replicas: dict[str, ReplicaModel] = {}
        self.replica_prior = ReplicaModel(self.prior, rate)  # a replica not seen yet
        self.priors: dict[str, Prior] = {}  # url -> its prior, where not the default
        self._unseen: dict[Prior, ReplicaModel] = {self.prior: self.replica_prior}

    def set_priors(self, priors: Mapping[str, Prior]) -> None:
        """The prior of each replica URL (those left out: the default). A replica already
        modelled takes its new prior only while it has learnt nothing (its factors are
        relative to the prior they were learnt against)."""
        self.priors = dict(priors)
        for url, model in self.replicas.items():
            prior = self.priors.get(url, self.prior)
            fresh = not model.samples and model.log_step == 0.0 == model.log_prefill
            if fresh and model.prior != prior:
                model.prior = prior
        wanted = {*self.priors.values(), self.prior}
        for prior in [p for p in self._unseen if p not in wanted]:
            del self._unseen[prior]

    def unseen_priors(self) -> list[Prior]:
        """The priors an unseen replica's model is kept for: the default and those some
        replica is given (`set_priors` drops the rest, so they do not pile up)."""
        return list(self._unseen)

    def unseen(self, url: str) -> ReplicaModel:
        """The model `url` would start from (read only: shared by every unseen replica of
        the same prior)."""
        prior = self.priors.get(url)
        if prior is None:
            return self.replica_prior
        model = self._unseen.get(prior)
        if model is None:
            model = self._unseen[prior] = ReplicaModel(prior, self.rate)
        return model

    def replica(self, url: str) -> ReplicaModel:
        model = self.replicas.get(url)
        if model is None:
            prior = self.priors.get(url, self.prior)
            model = self.replicas[url] = ReplicaModel(prior, self.rate)
        return model

    def predict(self, url: str, dispatch: Dispatch) -> tuple[float, float]:
        model = self.replicas.get(url)
        if model is None:  # not created on a read: predictions for unknown URLs cost nothing
            return self.unseen(url).predict(dispatch)
        return model.predict(dispatch)

    def observe(self, url: str, dispatch: Dispatch, ttft: float | None, itl: float | None) -> None:
        self.replica(url).observe(dispatch, ttft, itl)

    def others_itl(self, url: str, dispatch: Dispatch) -> float:
        model = self.replicas.get(url) or self.unseen(url)
        return model.others_itl(dispatch)

    def forget_replicas(self, keep: Iterable[str]) -> None:
        """Drop the models of replicas no longer in any target."""
        wanted = set(keep)
        for url in [u for u in self.replicas if u not in wanted]:
            del self.replicas[url]


def slo_cost(
    ttft: float, itl: float, ttft_target: float, itl_target: float, others_itl: float = 0.0
) -> float:
    """How far a prediction is from the SLO: the largest of the request's predicted TTFT
    and ITL and the ITL it leaves the requests already there (`others_itl`), each over its
    target (1: exactly at the target; under 1: within all)."""
    return max(ttft / ttft_target, itl / itl_target, others_itl / itl_target)


def slo_scores(costs: Mapping[str, float]) -> dict[str, float]:
    """The `slo` scorer's score per candidate from its `slo_cost` (higher is better).

    While some candidate is predicted within reach (cost at most OUT_OF_REACH),
    1 / (1 + cost): the most slack first. When none is, cost / (1 + cost): the replica
    already worst off first. Such a request misses wherever it goes, and it delays every
    stream on the replica it joins (its prefill stalls them, its queue slot holds later
    arrivals), so it goes where the streams are already lost and the other replicas stay
    within their SLO. Past the knee, spreading the overload evenly makes every replica
    miss; concentrating it keeps the rest of the fleet's goodput."""
    if not costs:
        return {}
    if min(costs.values()) <= OUT_OF_REACH:
        return {url: 1.0 / (1.0 + cost) for url, cost in costs.items()}
    return {url: cost / (1.0 + cost) for url, cost in costs.items()}


def speed_factors(
    models: dict[str, ReplicaModel], min_samples: int = MIN_SAMPLES_FOR_SPEED
) -> dict[str, float]:
    """Each replica's predicted time at the reference state over the median of its peers
    (1.6: 60% slower than the middle replica at the same batch and prompt). Replicas
    with fewer than `min_samples` answers are left out (their figure is the prior's)."""
    reference = REFERENCE
    times = {}
    for url, model in models.items():
        if model.samples < min_samples:
            continue
        ttft, itl = model.predict(reference)
        times[url] = math.sqrt(ttft * itl)  # both matter; a geometric mean keeps ratios
    if len(times) < 2:
        return {}
    ordered = sorted(times.values())
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {url: t / median for url, t in times.items()}
