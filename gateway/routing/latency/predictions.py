"""What the routing core knows about each replica's latency, around the pure model.

`Predictions` keeps the `latency.LatencyModel`, the prefill each replica still owes this
gateway (prompts sent there that have not begun to stream: "tokens ahead"), and the
metrics that show how good the predictions are. The ticket calls it at each phase:

    dispatch = predictions.sent(url, request, candidate)   # an attempt starts
    learnt = predictions.started(url, dispatch, ttft)      # its first token: TTFT learnt
    predictions.answered(labels, url, dispatch, ttft, itl) # a whole streamed answer
    predictions.broken(url, dispatch, learnt)              # ... or one that broke off
    predictions.abandoned(url, dispatch)                   # it ended before its first token

It learns from every policy's answers, so switching a model to `slo-aware` starts from
a model that already knows its replicas. A replica first seen starts from its own prior
(`replica_priors`, followed on each discovery change: `follow`): its simulator profile's
step costs where discovery knows them (a local fleet's `--engine sim` replicas), else its
model's `status.capacity.decodeTokensPerSecondBound` (`Prior.from_capacity`), else the
default (Llama 3.1 8B on one H100). `costs(...)` is what the `slo-aware` profile
ranks by (routing/router.py) and what its admission compares with the TTFT budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kubellm.gateway.discovery.base import ModelTarget
from kubellm.gateway.routing.index.kv_tiers import DEFAULT_VALUE, TierValue, cached_tokens
from kubellm.gateway.routing.latency.histogram import Histogram
from kubellm.gateway.routing.latency.model import (
    DECODE_BOUND_RANGE,
    PREFILL_RATE_WINDOW_S,
    Dispatch,
    LatencyModel,
    Prior,
    slo_cost,
    speed_factors,
)
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.scorers.prefix import CHUNK_CHARS, PrefixIndex
from prometheus_client import CollectorRegistry, Gauge

from kubellm import metrics

if TYPE_CHECKING:
    from kubellm.gateway.routing.index.precise_routing import PreciseRouting

# The simulator and the approximate prefix index count ~4 characters per token.
CHARS_PER_TOKEN = 4
_RATIO_BUCKETS = (0.5, 0.67, 0.8, 0.9, 0.95, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)
_LABELS = ("model", "deployment", "namespace", "url")
# A replica's factors fade toward the prior once it has had no answer for this long.
FADE_AFTER_S = 5.0
# TTFT errors kept per replica between two whole answers (the rest are not shown).
PENDING_RATIOS = 64
# Weight of each answer's length in the answers' mean length (`answer_tokens`), and that
# mean before any answer is seen.
ANSWER_RATE = 0.05
PRIOR_ANSWER_LENGTH = 150.0
# A replica's running count held at its maximum with a queue for this long (two scrapes)
# is its concurrency limit (`Predictions._slots`).
SLOT_EVIDENCE_S = 2.0


def prompt_tokens(request: RoutingRequest) -> int:
    """The prompt's length in tokens, estimated from its characters."""
    return request.prompt_chars // CHARS_PER_TOKEN


def replica_priors(targets: Iterable[ModelTarget]) -> dict[str, Prior]:
    """Each replica URL's prior where discovery knows better than the default: the
    endpoint's own step costs (a simulated replica's profile, exact), else its model's
    status.capacity decode bound (`Prior.from_capacity`). URLs left out take the default."""
    out: dict[str, Prior] = {}
    for target in targets:
        bound = target.decode_tokens_per_second_bound
        shared = None
        low, high = DECODE_BOUND_RANGE
        if bound is not None and low <= bound <= high:
            shared = Prior.from_capacity(bound)
        for endpoint in target.endpoints:
            costs = endpoint.step_costs
            if costs is not None:
                out[endpoint.url] = Prior(
                    costs.step_base_s, costs.prefill_token_s, costs.decode_token_s,
                    costs.max_num_batched_tokens,
                )  # fmt: skip
            elif shared is not None:
                out[endpoint.url] = shared
    return out


class Predictions:
    def __init__(
        self,
        prior: Prior | None = None,
        registry: CollectorRegistry | None = None,
        index_capacity: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = LatencyModel(prior)
        self.clock = clock
        # url -> (moving mean of uncached prompt tokens/s sent there, when last updated)
        self.rates: dict[str, tuple[float, float]] = {}
        self.answered_at: dict[str, float] = {}  # url -> the last answer learnt from, or fade
        # What was sent where, every prompt (the router's index leaves out cold prompts
        # sent away from their home, by design; the replica still caches them)
        self.index = PrefixIndex(index_capacity)
        # url -> [prefill tokens, requests] sent there that have not begun to stream
        self.ahead: dict[str, list[int]] = {}
        # TTFT learnt at the first token (`started` given one): url -> predicted/observed
        # ratios not yet in the histogram (it needs the model's labels: `answered`)
        self.early_ttft = False
        self._pending: dict[str, list[float]] = {}
        # url -> [its concurrency limit as seen (0: unknown), the most it ran]: see `_slots`;
        # the answers' mean length (tokens, streamed answers of every replica)
        self.slots: dict[str, list[float]] = {}
        self.answer_tokens = PRIOR_ANSWER_LENGTH
        # spec.routing.prefixIndex precise: the KV events' index (the router sets it), whose
        # match by tier replaces the record of what was sent where (`tiered`)
        self.precise: PreciseRouting | None = None
        self.tier_value: TierValue = DEFAULT_VALUE
        r = registry or CollectorRegistry()
        self._ratios: dict[tuple[tuple[str, str, str], str], tuple[Any, Any]] = {}
        self.ratio = Histogram(
            metrics.GATEWAY_PREDICTION_RATIO,
            "Predicted over observed latency of each streamed answer (kind=ttft|itl), per "
            "replica: 1 is exact, under 1 the replica was slower than predicted.",
            [*_LABELS, "kind"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.speed = Gauge(
            metrics.GATEWAY_SPEED_FACTOR,
            "Each replica's predicted latency at the same batch and prompt over the median "
            "of its model's replicas (1.6: 60% slower than its peers).",
            _LABELS,
            registry=r,
        )

    # ---------------------------------------------------------------- features

    def dispatch(
        self,
        url: str,
        request: RoutingRequest,
        candidate: Candidate,
        now: float | None = None,
        cached: int | None = None,
    ) -> Dispatch:
        """The replica's state for this request now. The prompts ahead count less what the
        replica has computed of them since the last of them began (the first token of the
        one before, or the time the queue formed): the gateway knows what it sent, not how
        far the engine has got, and counting whole prompts doubled the prefill ahead.
        `cached`: the prompt tokens the replica holds as its KV events say (`tiered`: a
        host or disk hit at its worth, so the prefill left carries the reload); None: as
        this gateway's record of the prompts it sent there says."""
        tokens = request.prompt_chars // CHARS_PER_TOKEN
        hashes = request.chunk_hashes
        ahead = self.ahead.get(url)
        if cached is not None:
            cached = min(tokens, cached)
        elif hashes:
            matched = self.index.matched(url, hashes)
            cached = min(tokens, matched * CHUNK_CHARS // CHARS_PER_TOKEN)
        else:
            cached = 0
        now = self.clock() if now is None else now
        running, waiting = candidate.running, candidate.waiting
        slots = 0.0 if running is None else self._slots(url, running, waiting, now)
        if ahead is None:
            ahead_tokens = ahead_requests = 0
        else:
            ahead_tokens, ahead_requests = ahead[0], ahead[1]
            if now > ahead[2]:
                model = self.model.replicas.get(url)
                done = (model or self.model.unseen(url)).drained(
                    now - ahead[2], candidate.running, candidate.in_flight
                )
                ahead_tokens = max(ahead_tokens - int(done), 0)
        return Dispatch(
            tokens, cached, ahead_tokens, ahead_requests, self.prefill_rate(url, now=now),
            candidate.in_flight, running, waiting, slots, self.answer_tokens,
        )  # fmt: skip

    def _slots(self, url: str, running: float, waiting: float | None, now: float) -> float:
        """The replica's concurrency limit (`max_num_seqs`, or what its KV cache holds) as
        its figures show it: pinned at the most it has ever run, with a queue, for
        SLOT_EVIDENCE_S; unknown (0) again once it runs more. (A queue at a count that
        moves is a prompt waiting for a step's token budget, not for a slot: taken as the
        limit, it predicted seconds of waiting on replicas that had slots free.)"""
        seen = self.slots.get(url)
        if seen is None:  # [limit (0: unknown), most run, count pinned at, since]
            seen = self.slots[url] = [0.0, 0.0, 0.0, now]
        if running > seen[1]:
            seen[1] = running
            if running > seen[0]:
                seen[0] = 0.0
        if waiting is None or waiting < 1 or running < seen[1]:
            seen[2] = 0.0  # not pinned
        elif running != seen[2]:
            seen[2], seen[3] = running, now
        elif now - seen[3] >= SLOT_EVIDENCE_S:
            seen[0] = running
        return seen[0]

    def prefill_rate(self, url: str, add: int = 0, now: float | None = None) -> float:
        """Uncached prompt tokens per second sent to `url` lately (decayed over the
        window), after adding `add` tokens sent now."""
        last = self.rates.get(url)
        if last is None and not add:
            return 0.0
        now = self.clock() if now is None else now
        rate, then = last or (0.0, now)
        if now != then:
            rate *= math.exp(-(now - then) / PREFILL_RATE_WINDOW_S)
        if add:
            rate += add / PREFILL_RATE_WINDOW_S
            self.rates[url] = (rate, now)
        return rate

    def costs(
        self,
        request: RoutingRequest,
        candidates: Sequence[Candidate],
        ttft_target: float,
        itl_target: float,
        cached: Mapping[str, int] | None = None,
    ) -> dict[str, tuple[float, float, float]]:
        """Per candidate URL: (SLO cost, predicted TTFT, predicted ITL); see latency.slo_cost
        (the cost counts the ITL this request leaves the ones already there too). `cached`:
        `tiered`'s answer (a URL left out: the record of what was sent there)."""
        out = {}
        model = self.model
        now = self.clock()
        for c in candidates:
            self._fade(c.url, now)
            dispatch = self.dispatch(c.url, request, c, None, (cached or {}).get(c.url))
            ttft, itl = model.predict(c.url, dispatch)
            others = model.others_itl(c.url, dispatch)
            out[c.url] = (slo_cost(ttft, itl, ttft_target, itl_target, others), ttft, itl)
        return out

    def tiered(self, target: ModelTarget, request: RoutingRequest) -> dict[str, int] | None:
        """The prompt tokens each of `target`'s replicas holds as its KV events say, by
        tier: a GPU block whole, a host or disk block at its worth (`tier_value`: 1 -
        reload / prefill per token, kv_tiers.cached_tokens), so the prediction's prefill
        includes the reload. Only replicas whose events are fresh; None where the model
        is not routed by the precise index (or its prompt cannot be hashed)."""
        precise = self.precise
        if precise is None or target.routing.prefix_index != "precise":
            return None
        # hashed once per body (PreciseRouting keeps the last few requests' hashes)
        hashes = request.kv_hashes or precise.kv_hashes(target, request.body)
        if not hashes:
            return None
        index, out = precise.index, {}
        size = precise.block_size(target)  # a replica with only offloaded blocks: its peers'
        for endpoint in target.endpoints:
            url = endpoint.url
            block = index.block_size(url) or size
            if block and precise.fresh(url):
                held = index.matched_by_tier(url, hashes)
                out[url] = cached_tokens(self.tier_value, *held, block)
        return out

    def _fade(self, url: str, now: float) -> None:
        """A replica without answers for a while drifts back to the prior (latency.fade)."""
        then = self.answered_at.get(url)
        if then is not None and now - then > FADE_AFTER_S and url in self.model.replicas:
            self.model.replicas[url].fade(now - then)
            self.answered_at[url] = now

    # ---------------------------------------------------------------- the ticket's calls

    def sent(
        self, url: str, request: RoutingRequest, candidate: Candidate, cached: int | None = None
    ) -> Dispatch:
        """An attempt starts on `url`: its features (`cached`: as `dispatch`), and its
        prefill counted as ahead."""
        now = self.clock()
        dispatch = self.dispatch(url, request, candidate, now, cached)
        uncached = dispatch.uncached
        ahead = self.ahead.get(url)
        if ahead is None:  # [tokens, requests, when the first of them began its prefill]
            self.ahead[url] = [uncached, 1, now]
        else:
            ahead[0] += uncached
            ahead[1] += 1
        if uncached:
            rate = dispatch.prefill_rate + uncached / PREFILL_RATE_WINDOW_S
            self.rates[url] = (rate, now)
        if request.chunk_hashes:
            self.index.record(url, request.chunk_hashes)
        return dispatch

    def started(
        self, url: str, dispatch: Dispatch, ttft: float | None = None
    ) -> tuple[float, float] | None:
        """Its first token streamed `ttft` seconds after dispatch: its prefill is done, and
        (given `ttft`) the model learns the TTFT now rather than when the whole answer has
        streamed, seconds later (a replica flooded before its first answer ends was
        predicted at the prior all that time). Returns what that moved the replica's
        factors by (log step, log prefill), for `broken` to take back if the stream does
        not end whole; None when nothing was learnt. The TTFT's error reaches the
        histogram with the answer (`answered`, which then learns only the ITL)."""
        learnt = None
        if ttft is not None:
            self.early_ttft = True
            if ttft > 0 and math.isfinite(ttft):
                model = self.model.replica(url)
                step, prefill = model.log_step, model.log_prefill
                predicted, _ = model.learn(dispatch, ttft, None, False)
                learnt = (model.log_step - step, model.log_prefill - prefill)
                pending = self._pending.setdefault(url, [])
                if len(pending) < PENDING_RATIOS:
                    pending.append(predicted / ttft)
        self._owes_nothing(url, dispatch)
        return learnt

    def _owes_nothing(self, url: str, dispatch: Dispatch) -> None:
        """The attempt owes no prefill any more (it streamed, or ended before)."""
        ahead = self.ahead.get(url)
        if ahead is None:
            return
        ahead[0] -= dispatch.uncached
        ahead[1] -= 1
        if ahead[1] <= 0:
            del self.ahead[url]
        else:
            ahead[2] = self.clock()  # the next one's prefill goes on from here

    def abandoned(self, url: str, dispatch: Dispatch) -> None:
        """It ended before streaming: it owes no prefill either, and nothing is learnt."""
        self._owes_nothing(url, dispatch)

    def broken(self, url: str, dispatch: Dispatch, learnt: tuple[float, float] | None) -> None:
        """An answer that began to stream and broke off: the TTFT `started` learnt from it
        (`learnt`) is taken back (only answers that end whole teach the model), and the
        break is learnt as a late answer (`ReplicaModel.failed`). A replica that sends one
        token at once and drops the connection is not learnt as the fastest."""
        model = self.model.replica(url)
        if learnt is not None:
            model.unlearn(*learnt)
        model.failed(dispatch)

    def answered(
        self,
        labels: tuple[str, str, str],
        url: str,
        dispatch: Dispatch,
        ttft: float | None,
        itl: float | None,
        tokens: int | None = None,
    ) -> None:
        """A whole streamed answer (of `tokens` events carrying text, where known): the error
        of what was predicted, then learn from it (only its ITL when `started` learnt its
        TTFT), and its length in the answers' mean length."""
        if tokens is not None and tokens > 0:
            self.answer_tokens += ANSWER_RATE * (tokens - self.answer_tokens)
        early = self.early_ttft
        predicted_ttft, predicted_itl = self.model.replica(url).learn(
            dispatch, None if early else ttft, itl
        )
        ratios = self._ratios.get((labels, url))
        if ratios is None:  # the histogram's children, looked up once per model and replica
            ratios = self._ratios[labels, url] = (
                self.ratio.labels(*labels, url, "ttft"), self.ratio.labels(*labels, url, "itl"),
            )  # fmt: skip
        if early:
            pending = self._pending.pop(url, None)
            for ratio in pending or ():
                ratios[0].observe(ratio)
        elif ttft is not None and ttft > 0:
            ratios[0].observe(predicted_ttft / ttft)
        if itl is not None and itl > 0:
            ratios[1].observe(predicted_itl / itl)
        self.answered_at[url] = self.clock()

    def follow(self, targets: Iterable[ModelTarget]) -> None:
        """Discovery's models changed: each replica's prior (`replica_priors`; a replica
        first seen after this starts from it), and what is kept about replicas no longer
        in any model dropped (`forget`)."""
        targets = list(targets)
        self.model.set_priors(replica_priors(targets))
        self.forget([e.url for t in targets for e in t.endpoints])

    def forget(self, keep: Sequence[str]) -> None:
        """Drop what is kept about replicas no longer in any model (bounded state: a fleet
        that replaces its pods does not grow these maps)."""
        wanted = set(keep)
        self.model.forget_replicas(wanted)
        for table in (self.ahead, self.rates, self.answered_at, self._pending, self.slots):
            for url in [u for u in table if u not in wanted]:
                del table[url]
        for key in [k for k in self._ratios if k[1] not in wanted]:
            del self._ratios[key]

    def publish_speed(self, labels: tuple[str, str, str], urls: Sequence[str]) -> None:
        """Set the speed-factor gauge of one model's replicas (those with enough answers)."""
        models = {u: self.model.replicas[u] for u in urls if u in self.model.replicas}
        for url, factor in speed_factors(models).items():
            self.speed.labels(*labels, url).set(round(factor, 3))
