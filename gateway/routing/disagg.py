"""Prefill/decode disaggregation, decided per request (pure; issue 41).

The decode replica is picked as for any request (prefix, load, SLO: the admission pass);
then `decide` says whether the prompt's uncached part is computed there (local) or on the
best prefill replica with its KV cache moved over the link (split):

    transfer   = KV bytes per token x uncached tokens / link bytes per second
    split TTFT = the prefill replica's predicted TTFT (its queue and the prompt)
               + transfer + one step of the decode replica (the first token it makes)
    local TTFT = the decode replica's predicted TTFT (the latency model's)
    harm       = the mean ITL of the streams already decoding there once this prompt adds
                 to the prompt work the replica computes beside them (the latency model's
                 `others_itl`: its step over 1 - the share of its time spent on prompts)
               + the stall: this prompt's compute (uncached x one token's), which every
                 stream there waits out, spread over an answer of the mean length lately

Conditional compares the two as the slo-aware policy compares replicas (`latency.slo_cost`:
the worst of TTFT / its target and ITL / its target): local costs max(local TTFT / TTFT
target, harm / ITL target); split costs max(split TTFT / TTFT target, one decode step /
ITL target) (the streams there are spared the prompt). It splits when the split's cost is
under the local one's by the margin (`PrefillSplit.margin`): `itl-harm` when the streams'
ITL is what the local prefill costs most, `faster-ttft` when the TTFT is (a decode replica
with a queue beside an idle prefill pool). A split that would miss a TTFT target the local
prefill meets or beats is `prefill-busy`.

Past a target the point cost weighs one request against one: the local side's ITL harm falls
on every stream there, the split's TTFT on this request and the prompts that queue behind it
on its prefill replica. So when either side is predicted past a target, the two are compared
by their summed excess, each miss counted by how far past its target it is and by how many
requests carry it (linear: it keeps growing with the overload, where a miss probability
saturates near 1): local = (local TTFT / target - 1)+ + streams x (harm / ITL target - 1)+;
split = (1 + prompts queued on the prefill replica) x (split TTFT / target - 1)+ + streams x
(one decode step / ITL target - 1)+ (the prompts queued there stand for those that arrive
behind it while it is computed: as many, in a queue that holds its length). The smaller
wins: a split is `itl-harm` (or `faster-ttft` where the local TTFT's excess is the larger
part), a local prefill `prefill-busy` (or `no-gain` with the split within its TTFT target).
Within both targets the point cost and the margin decide, as above. Always: split whenever
a prefill replica is ready (for comparison, as production-stack and vllm-router do).

Each decision has a reason, counted by the front ends (`kubellm_gateway_disagg_decisions_total`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kubellm.gateway.discovery.base import PrefillSplit
from kubellm.gateway.protocol.kv_transfer import kv_params_of, prefill_body
from kubellm.gateway.routing.latency.metrics import labels
from kubellm.gateway.routing.latency.predictions import CHARS_PER_TOKEN, PRIOR_ANSWER_LENGTH
from prometheus_client import CollectorRegistry, Counter, Histogram

from kubellm import metrics

if TYPE_CHECKING:
    from kubellm.gateway.routing.latency.predictions import Predictions
    from kubellm.gateway.routing.lifecycle import Ticket
    from kubellm.gateway.routing.scheduler import Scheduler
    from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest

# A front end's way to send a prefill leg: (URL, body, deadline seconds) -> the answer's
# body when its status is 200; None on another status or any error of its client.
Post = Callable[[str, bytes, float], Awaitable[bytes | None]]

__all__ = [
    "PREFILL_DEADLINE_FACTOR", "REASONS", "DisaggMetrics", "Inputs", "Post", "Verdict",
    "decide", "plan", "prefill_leg",
]  # fmt: skip

# The prefill leg may take this many times its predicted split TTFT (at least the TTFT
# target) before the request falls back to local prefill: past it the prediction was
# wrong by more than the model's worst error, and the decode replica is a sure answer.
PREFILL_DEADLINE_FACTOR = 3.0

# A prompt whose uncached part is under this is computed where it decodes: the ITL harm of
# one chunk this small is under a millisecond on every profile, and a second leg costs an
# HTTP round trip and a KV handshake.
MIN_SPLIT_TOKENS = 128

REASONS = (
    "no-prefill-replica", "always", "short-prompt", "cached-prefix", "prefill-busy",
    "itl-harm", "faster-ttft", "no-gain",
)  # fmt: skip


@dataclass(frozen=True)
class Inputs:
    """What one decision reads (seconds, tokens, bytes)."""

    prompt_tokens: int
    uncached_tokens: int  # on the chosen decode replica
    local_ttft: float  # predicted on the decode replica with the prompt computed there
    decode_step_s: float  # one decode step there now (its batch's)
    others_itl: float  # the streams there with this prompt computed beside them (0: none)
    prefill_token_s: float  # one prompt token's compute there
    step_tokens: int  # the prompt tokens one step computes at most (chunked prefill)
    prefill_ttft: float | None  # the best prefill replica's predicted TTFT; None: none ready
    kv_bytes_per_token: int
    link_bytes_per_s: float
    ttft_target: float
    itl_target: float
    split: Literal["Conditional", "Always"] = "Conditional"
    answer_tokens: float = PRIOR_ANSWER_LENGTH  # the answers' mean length lately (tokens)
    margin: float = PrefillSplit.margin  # the share the split's cost must be under local's
    streams: float = 0.0  # the sequences decoding on the decode replica (this one not)
    prefill_queued: float = 0.0  # the prompts queued on the prefill replica (this one not)


@dataclass(frozen=True)
class Verdict:
    split: bool
    reason: str
    transfer_s: float = 0.0
    split_ttft: float = 0.0
    local_itl_harm: float = 0.0  # the ITL the streams there would see with local prefill


def decide(x: Inputs) -> Verdict:
    """Split or local, and why."""
    if x.prefill_ttft is None:
        return Verdict(False, "no-prefill-replica")
    transfer = x.kv_bytes_per_token * x.uncached_tokens / x.link_bytes_per_s
    split_ttft = x.prefill_ttft + transfer + x.decode_step_s
    chunk = min(x.uncached_tokens, x.step_tokens)
    # The streams there wait out this prompt's compute (its uncached tokens', however it is
    # chunked): a stall each of them carries in its mean ITL, spread over its answer. The
    # latency model's `others_itl` reads the prompt only as a rate over its window, the
    # replica's mean: measured on 70B 3:1 (docs/operations.md, "The stall"), each long
    # prompt kept local pushed 1-2.6 streams past the ITL target by its stall alone.
    # A prompt computed within a decode step's time stalls nobody past the step's own jitter.
    stall = x.uncached_tokens * x.prefill_token_s
    stalls = x.others_itl > 0 and stall > x.decode_step_s
    harm = x.others_itl + stall / max(x.answer_tokens, 1.0) if stalls else x.others_itl

    def verdict(split: bool, reason: str) -> Verdict:
        return Verdict(split, reason, transfer, split_ttft, harm)

    if x.split == "Always":
        return verdict(True, "always")
    if x.uncached_tokens < MIN_SPLIT_TOKENS:
        cached = x.prompt_tokens - x.uncached_tokens >= MIN_SPLIT_TOKENS
        return verdict(False, "cached-prefix" if cached else "short-prompt")
    local_ttft, local_itl = x.local_ttft / x.ttft_target, harm / x.itl_target
    split_ttft_cost, step_itl = split_ttft / x.ttft_target, x.decode_step_s / x.itl_target
    # past a target: each side's misses summed over the requests that carry them
    late, slow = max(local_ttft - 1.0, 0.0), x.streams * max(local_itl - 1.0, 0.0)
    local_excess = late + slow
    split_excess = (1.0 + x.prefill_queued) * max(split_ttft_cost - 1.0, 0.0) + (
        x.streams * max(step_itl - 1.0, 0.0)
    )
    if local_excess > 0.0 or split_excess > 0.0:
        if split_excess < local_excess:
            return verdict(True, "itl-harm" if slow >= late else "faster-ttft")
        return verdict(False, "prefill-busy" if split_ttft > x.ttft_target else "no-gain")
    local = max(local_ttft, local_itl)
    split = max(split_ttft_cost, step_itl)
    if split < local * (1.0 - x.margin):
        return verdict(True, "itl-harm" if local_itl >= local_ttft else "faster-ttft")
    if split_ttft > x.ttft_target and split_ttft > x.local_ttft:
        return verdict(False, "prefill-busy")
    mostly_cached = x.prompt_tokens >= 2 * x.uncached_tokens
    short = chunk * x.prefill_token_s <= x.decode_step_s
    return verdict(
        False, "cached-prefix" if mostly_cached else "short-prompt" if short else "no-gain"
    )


def plan(
    predictions: Predictions,
    request: RoutingRequest,
    decode: Candidate,
    prefills: Sequence[Candidate],
    settings: PrefillSplit,
    ttft_target: float,
    itl_target: float,
) -> tuple[Verdict, str | None]:
    """The decision for `request` on decode replica `decode`, from the latency model's
    state, and the prefill replica it would use (the lowest predicted TTFT; None: none)."""
    model = predictions.model
    here = predictions.dispatch(decode.url, request, decode)
    local_ttft, _ = model.predict(decode.url, here)
    replica = model.replicas.get(decode.url) or model.unseen(decode.url)
    step, prefill = replica.speed
    prior = replica.prior
    best, best_ttft, queued = None, None, 0.0
    for c in prefills:
        # the prefill replica computes the whole uncached prompt (its own prefix cache aside)
        there = predictions.dispatch(c.url, request, c)
        ttft, _ = model.predict(c.url, there)
        if best_ttft is None or ttft < best_ttft:
            best, best_ttft, queued = c.url, ttft, there.ahead_requests + there.others
    verdict = decide(
        Inputs(
            prompt_tokens=here.prompt_tokens,
            uncached_tokens=here.uncached,
            local_ttft=local_ttft,
            decode_step_s=step * (prior.step_base_s + prior.decode_token_s * here.batch),
            others_itl=model.others_itl(decode.url, here),
            prefill_token_s=prefill * prior.prefill_token_s,
            step_tokens=prior.max_num_batched_tokens,
            prefill_ttft=best_ttft,
            kv_bytes_per_token=settings.kv_bytes_per_token,
            link_bytes_per_s=settings.link_bytes_per_s,
            ttft_target=ttft_target,
            itl_target=itl_target,
            split=settings.split,
            answer_tokens=here.answer_tokens or PRIOR_ANSWER_LENGTH,
            margin=settings.margin,
            streams=max(here.batch - 1.0, 0.0),
            prefill_queued=queued,
        )
    )
    return verdict, best if verdict.split else None


_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


class DisaggMetrics:
    """The split's metrics, per model (`lifecycle.labels`: model, namespace, deployment)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        names = ["model", "deployment", "namespace"]
        self.decisions = Counter(
            metrics.GATEWAY_DISAGG_DECISIONS,
            "Split decisions of requests to models with a prefill role, by reason.",
            [*names, "split", "reason"], registry=registry,
        )  # fmt: skip
        self.legs = Counter(
            metrics.GATEWAY_DISAGG_LEGS,
            "Legs of split requests by role and outcome (prefill failed: computed locally).",
            [*names, "role", "outcome"], registry=registry,
        )  # fmt: skip
        self.prefill = Histogram(
            metrics.GATEWAY_DISAGG_PREFILL,
            "Seconds of each prefill leg that returned its KV cache's params.",
            names, buckets=_SECONDS, registry=registry,
        )  # fmt: skip
        self.transfer = Histogram(
            metrics.GATEWAY_DISAGG_TRANSFER,
            "Seconds each split request's KV transfer takes as predicted (KV bytes / link).",
            names, buckets=_SECONDS, registry=registry,
        )  # fmt: skip

    def decided(self, labels: tuple[str, str, str], verdict: Verdict) -> None:
        self.decisions.labels(*labels, str(verdict.split).lower(), verdict.reason).inc()
        if verdict.split:
            self.transfer.labels(*labels).observe(verdict.transfer_s)


async def prefill_leg(
    scheduler: Scheduler,
    disagg: DisaggMetrics,
    ticket: Ticket,
    decode: Candidate,
    path: str,
    body: dict[str, Any],
    post: Post,
) -> dict[str, Any] | None:
    """Decide for the admitted `ticket` (its decode replica `decode`; tenancy, quotas and
    flow control counted the request once, at admission) and, on a split, send the prefill
    leg through `post`: the returned `kv_transfer_params` for the decode leg, or None (local
    prefill: no split, or the leg failed, stalled, passed its deadline or answered no
    params; the client sees one answer either way)."""
    target = ticket.target
    settings = target.prefill
    if settings is None:
        return None
    # the decode replica's revision only: a canary request's two legs stay on the canary
    revision = next((e.revision for e in target.endpoints if e.url == decode.url), None)
    same = tuple(e for e in target.prefill_endpoints if e.revision == revision)
    prefills = scheduler.router.candidates(target, same)
    slo = target.slo
    verdict, url = plan(
        scheduler.predictions, ticket.routing, decode, prefills, settings,
        slo.ttft_seconds, slo.itl_seconds,
    )  # fmt: skip
    names = labels(target)
    disagg.decided(names, verdict)
    if url is None:
        return None
    candidate = next(c for c in prefills if c.url == url)
    deadline = max(slo.ttft_seconds, PREFILL_DEADLINE_FACTOR * verdict.split_ttft)
    start = time.monotonic()
    release = scheduler.load.acquire(url)
    dispatch = scheduler.predictions.sent(url, ticket.routing, candidate)
    params = None
    try:
        async with asyncio.timeout(deadline):
            answer = await post(url + path, prefill_body(body), deadline)
        params = None if answer is None else kv_params_of(answer)
    except TimeoutError:  # the deadline (a front end's `post` answers None on its errors)
        params = None
    finally:
        release()
        scheduler.predictions.abandoned(url, dispatch)
    if params is None:
        scheduler.failed(url)
        disagg.legs.labels(*names, "prefill", "failed").inc()
        return None
    scheduler.outliers.success(url)
    disagg.legs.labels(*names, "prefill", "ok").inc()
    disagg.prefill.labels(*names).observe(time.monotonic() - start)
    # the decode replica computes none of the prompt: predicted and learnt as cached
    ticket.routing = ticket.routing._replace(prompt_chars=CHARS_PER_TOKEN)
    return params
