"""The shadow step: a sample of the stable revision's requests mirrored to the canary, and
the comparison of the answers.

While a canary step runs with `status.rollout.shadow` (discovery's `CanarySplit.shadow_*`),
`Mirror.offer` takes a share of the requests a stable replica serves (after the client's
request went out: the stable answer is never held up) and, in the background, asks the
same stable replica and a canary replica for the same greedy decoding (temperature 0, a
fixed seed, at most 2k tokens, logprobs). The client never sees either answer; the pair
goes through neither admission nor the tenants' quotas, and is counted only in the
`kubellm_gateway_mirror_*` series (labelled with the canary's revision). A mirror is shed,
never queued: past the step's concurrency cap, while the chosen canary replica reports
waiting requests, or with no canary replica ready. Each answer is bounded in time and
bytes (a replica may be hostile).

The comparison (pure), decoded the same way on both sides:

- `first_k_agree`: both answers' first k tokens are the same (the share of mirrored
  requests that agree is the quality gate's `agreement`);
- `token_agreement`: positions compared (the stable answer's length) and positions that
  agree; past the first disagreement the contexts differ, so later positions compare
  answers, not distributions (both count: a shorter canary answer disagrees on the rest);
- `divergence`: with logprobs, the mean of logp_stable(t) - logp_canary(t) over the stable
  answer's tokens t up to and including the first disagreement (the contexts are the same
  there): a one-sample estimate of KL(stable || canary) in nats per token. A token missing
  from the canary's top logprobs counts at the lowest logprob the canary listed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import random
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from kubellm.gateway.discovery.base import CanarySplit, ModelTarget
from kubellm.gateway.protocol import assemble
from kubellm.gateway.routing.canary.revisions import size_class
from kubellm.gateway.routing.latency.metrics import CLASS_TPOT_BUCKETS
from kubellm.gateway.routing.replicas.load import LoadView
from prometheus_client import CollectorRegistry, Counter, Histogram, Summary

from kubellm import metrics

log = logging.getLogger(__name__)

MIRROR_TIMEOUT = 60.0  # seconds for one mirrored answer, whole
MAX_ANSWER_BYTES = 1 << 20  # a greedy answer of at most 512 tokens with logprobs
TOP_LOGPROBS = 5


def first_k_agree(stable: Sequence[str], canary: Sequence[str], k: int) -> bool:
    """Whether the first `k` tokens agree (an answer shorter than k must match whole)."""
    return list(stable[:k]) == list(canary[:k])


def token_agreement(stable: Sequence[str], canary: Sequence[str]) -> tuple[int, int]:
    """(positions compared, positions that agree) over the stable answer's tokens."""
    agreed = sum(1 for a, b in zip(stable, canary, strict=False) if a == b)
    return len(stable), agreed


def divergence(
    stable: Sequence[tuple[str, float]], canary: Sequence[Mapping[str, float]]
) -> list[float]:
    """Per token of the stable answer up to the first disagreement: logp_stable(t) -
    logp_canary(t) (at least 0). `stable`: (token, its logprob); `canary`: per position,
    the canary's top logprobs {token: logprob} with its own chosen token among them."""
    out = []
    for (token, logprob), top in zip(stable, canary, strict=False):
        if not top:
            break
        out.append(max(0.0, logprob - top.get(token, min(top.values()))))
        if max(top, key=top.__getitem__) != token:
            break  # the canary chose otherwise: the contexts differ from here
    return out


# --------------------------------------------------------------------------- answers


class MirrorFailed(Exception):
    """A mirrored request got no usable answer (counted, never raised to a client)."""


def greedy_body(
    body: Mapping[str, Any], chat: bool, first_tokens: int, keep: bool = False
) -> dict[str, Any]:
    """The mirrored request: the client's, decoded greedily with a fixed seed (`keep`: with
    the client's own decoding, greedy or seeded), at most 2k tokens, not streamed, one
    choice, with the top logprobs of each token."""
    dropped = ("stream", "stream_options", "n", "best_of", "max_completion_tokens")
    out = {k: v for k, v in body.items() if k not in dropped}
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    wanted = 2 * first_tokens
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < wanted:
        wanted = limit
    out.update(stream=False, n=1, max_tokens=wanted)
    if not keep:
        out.update(temperature=0, top_p=1, seed=0)
    if chat:
        out.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
    else:
        out["logprobs"] = TOP_LOGPROBS
    return out


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MirrorFailed("a logprob that is not a finite number")
    return float(value)


def answer_tokens(
    answer: Any, limit: int
) -> tuple[list[str], list[tuple[str, float]] | None, list[dict[str, float]] | None, int]:
    """(tokens, [(token, logprob)] or None, per position the top logprobs or None, output
    tokens) of an OpenAI answer (chat or completions), at most `limit` tokens. Without
    logprobs the tokens are the text's words. MirrorFailed for anything unreadable."""
    try:
        choice = answer["choices"][0]
        logprobs = choice.get("logprobs")
        chosen: list[tuple[str, float]] = []
        tops: list[dict[str, float]] = []
        if isinstance(logprobs, Mapping) and isinstance(logprobs.get("content"), list):
            for entry in logprobs["content"][:limit]:  # chat
                token, value = str(entry["token"]), _number(entry["logprob"])
                top = {str(t["token"]): _number(t["logprob"])
                       for t in (entry.get("top_logprobs") or [])[:TOP_LOGPROBS]}  # fmt: skip
                chosen.append((token, value))
                tops.append({**top, token: value})
        elif isinstance(logprobs, Mapping) and isinstance(logprobs.get("tokens"), list):
            values = logprobs.get("token_logprobs") or []
            top_list = logprobs.get("top_logprobs") or []
            for i, token in enumerate(logprobs["tokens"][:limit]):  # completions
                value = _number(values[i])
                top = top_list[i] if i < len(top_list) and isinstance(top_list[i], Mapping) else {}
                top = {str(t): _number(v) for t, v in list(top.items())[:TOP_LOGPROBS]}
                chosen.append((str(token), value))
                tops.append({**top, str(token): value})
        usage = answer.get("usage") or {}
        produced = usage.get("completion_tokens") if isinstance(usage, Mapping) else None
        if chosen:
            tokens = [t for t, _ in chosen]
            count = produced if isinstance(produced, int) and produced > 0 else len(tokens)
            return tokens, chosen, tops, count
        text = choice.get("text")
        if text is None:
            text = (choice.get("message") or {}).get("content") or ""
        tokens = str(text).split()[:limit]
        count = produced if isinstance(produced, int) and produced > 0 else len(tokens)
        return tokens, None, None, count
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as error:
        raise MirrorFailed(f"an answer with no readable choice ({type(error).__name__})") from None


# --------------------------------------------------------------------------- metrics


_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, MirrorMetrics] = weakref.WeakKeyDictionary()


def metrics_for(registry: CollectorRegistry) -> MirrorMetrics:
    """The mirror's series in `registry` (one set, however many front ends share it)."""
    found = _METRICS.get(registry)
    if found is None:
        found = _METRICS[registry] = MirrorMetrics(registry)
    return found


class MirrorMetrics:
    """The mirror's series, per model and canary revision (operator/figures.py reads them
    into the canary's figures)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        names = ["model", "deployment", "namespace", "revision"]
        classed = [*names, "class"]

        def counter(name: str, text: str, labels: list[str]) -> Counter:
            return Counter(name.removesuffix("_total"), text, labels, registry=registry)

        self.compared = counter(
            metrics.GATEWAY_MIRROR_REQUESTS,
            "Mirrored requests whose two answers were compared.",
            classed,
        )
        self.agreed = counter(metrics.GATEWAY_MIRROR_AGREED,
                              "Mirrored requests whose greedy answers agree on the first k "
                              "tokens.", classed)  # fmt: skip
        self.tokens = counter(metrics.GATEWAY_MIRROR_TOKENS,
                              "Token positions of the stable answers compared.", names)  # fmt: skip
        self.tokens_agreed = counter(metrics.GATEWAY_MIRROR_TOKENS_AGREED,
                                     "Token positions where the canary agreed.", names)  # fmt: skip
        self.shed = counter(metrics.GATEWAY_MIRROR_SHED,
                            "Mirrors not sent or not compared, by reason (busy: the cap; "
                            "canary-queue; no-canary; failed).", [*names, "reason"])  # fmt: skip
        self.divergence = Summary(
            metrics.GATEWAY_MIRROR_DIVERGENCE,
            "Per compared token: logp_stable - logp_canary of the stable answer's token.",
            names, registry=registry,
        )  # fmt: skip
        self.tpot = Histogram(
            metrics.GATEWAY_MIRROR_TPOT,
            "The canary's whole mirrored answer time per output token.",
            classed, buckets=CLASS_TPOT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.stable_tpot = Histogram(
            metrics.GATEWAY_MIRROR_STABLE_TPOT,
            "The stable replica's time per output token on the same mirrored requests.",
            classed, buckets=CLASS_TPOT_BUCKETS, registry=registry,
        )  # fmt: skip


Post = Callable[[str, str, dict[str, Any]], Awaitable[tuple[Any, float]]]

REFERENCE_BYTES = 256 * 1024  # the client's answer kept as the reference, at most
MAX_WAITING = 64  # mirrors waiting for their client's answer to end, per gateway


def reusable(body: Mapping[str, Any], path: str) -> bool:
    """Whether the client's own answer can be the stable side's reference: one choice,
    decoded greedily (temperature 0) or with a fixed seed (vLLM honours `seed`: the same
    revision draws the same tokens), no beam search."""
    if body.get("use_beam_search") or assemble.choices_of(dict(body), path) != 1:
        return False
    if body.get("best_of") not in (None, 1):
        return False
    temperature, seed = body.get("temperature"), body.get("seed")
    if (
        isinstance(temperature, int | float)
        and not isinstance(temperature, bool)
        and (temperature == 0)
    ):
        return True
    return isinstance(seed, int) and not isinstance(seed, bool)


def text_agreement(
    reference: str, canary: Sequence[str], k: int, limit: int, text: str | None = None
) -> tuple[bool, int, int]:
    """The comparison when the stable side's answer is text (the client's own answer, no
    logprobs): (first k agree, positions compared, positions that agree). The canary's
    tokens are laid along the reference text; a token agrees while the text so far is the
    same, so positions past the first disagreement count as disagreeing. A canary answer
    shorter than k (and than `limit`, the tokens it was asked for) agrees only when it is
    the whole reference. `text`: the canary's answer text where known: the same as the
    reference, every token agrees (an end-of-sequence token is listed with a string the
    text leaves out)."""
    joined = "".join(canary) if text is None else text
    common = next((i for i, (a, b) in enumerate(zip(reference, joined, strict=False))
                   if a != b), min(len(reference), len(joined)))  # fmt: skip
    whole = reference == joined
    ends = itertools.accumulate(len(token) for token in canary)  # increasing
    aligned = len(canary) if whole else sum(1 for end in ends if end <= common)
    first = aligned >= min(k, len(canary)) and (len(canary) >= k or whole)
    compared = len(canary)
    if not whole and aligned == len(canary) and len(canary) < limit:
        compared += 1  # the canary stopped where the stable answer went on
    return first, compared, aligned


class _Reference:
    """The client's answer from the stable replica as it passes (`Ticket.tap`), at most
    REFERENCE_BYTES; at its end the mirror goes on (`Mirror._ended`)."""

    def __init__(self, mirror: Mirror, job: _Job, stream: bool, chat: bool) -> None:
        self.mirror = mirror
        self.job = job
        self.assembler = assemble.Assembler(chat, REFERENCE_BYTES) if stream else None
        self.raw: bytearray | None = None if stream else bytearray()
        self.over = False

    def feed(self, data: bytes) -> None:
        if self.over:
            return
        try:
            if self.assembler is not None:
                self.assembler.feed(data)
            else:
                assert self.raw is not None
                self.raw += data
                if len(self.raw) > REFERENCE_BYTES:
                    raise assemble.AssemblyError("too long")
        except assemble.AssemblyError:
            self.over, self.assembler, self.raw = True, None, None

    def answer(self) -> Any | None:
        """The whole answer (parsed), or None (too long, cut off, not JSON)."""
        try:
            if self.assembler is not None:
                return json.loads(self.assembler.answer())
            return None if self.raw is None else json.loads(self.raw)
        except (assemble.AssemblyError, ValueError):
            return None

    def end(self, whole: bool) -> None:
        self.mirror._ended(self.job, self.answer() if whole and self.job.reuse else None, whole)


class _Job:
    """One mirrored request, from `offer` to its comparison."""

    __slots__ = ("asking", "body", "canary", "chat", "labels", "path", "reuse", "since", "size",
                 "split", "stable", "ticket", "tokens")  # fmt: skip

    def __init__(self, labels: tuple[str, ...], split: CanarySplit, stable: str, canary: str,
                 path: str, body: Mapping[str, Any], size: str, ticket: Any) -> None:  # fmt: skip
        self.labels, self.split, self.stable, self.canary = labels, split, stable, canary
        self.path, self.body, self.size, self.ticket = path, body, size, ticket
        self.chat = path.endswith("chat/completions")
        self.reuse = ticket is not None and reusable(body, path)
        self.since = ticket.arrived if ticket is not None else time.monotonic()
        self.tokens = 0  # the client's answer's text events (its output tokens, about)
        self.asking = False  # holds a reference ask on the stable replica


class Mirror:
    """The shadow step of one gateway: `offer` after a stable replica took a request.

    The canary is asked once the client's answer from stable ended (the client's request is
    never slowed by its own mirror). When the client asked for greedy or seeded decoding,
    its own answer (kept as it passed, bounded) is the stable side's reference and only the
    canary is asked, with the client's decoding. The HTTP gateway draws before forwarding
    (`draw`) and gives a drawn request that samples without a seed a random one (`seeded`),
    so its answer is a reference too. Otherwise (several choices, beam search, the endpoint
    picker, which forwards nothing itself) both are asked for a greedy
    answer, and the stable replica only when it is idle (nothing running or waiting there,
    no other reference ask of this gateway on it): shed first (`stable-busy`), never
    queued behind or beside the clients' requests."""

    def __init__(
        self, metrics_: MirrorMetrics, post: Post, load: LoadView, rng: random.Random | None = None
    ) -> None:
        self.metrics = metrics_
        self.post = post
        self.load = load
        self.rng = rng or random.Random()
        self.in_flight = 0  # mirrors asking the engines
        self.waiting = 0  # mirrors waiting for their client's answer to end
        self.asking: dict[str, int] = {}  # reference asks per stable replica
        self.tasks: set[asyncio.Task[None]] = set()

    def draw(self, target: ModelTarget) -> bool:
        """Before a request is forwarded: whether the step's share draws it for the mirror
        (`offer(..., drawn=True)` once a replica took it)."""
        split = target.canary
        share = split.shadow_share if split is not None else 0.0
        return share > 0 and self.rng.random() < share

    def seeded(self, body: Mapping[str, Any], path: str) -> dict[str, Any] | None:
        """A drawn request that samples with no `seed` (and one choice), with a random one
        added before it is forwarded: the engine honours it, the client's answer is drawn
        from the same distribution, and that answer becomes the stable side's reference
        (the stable replica is not asked again). None: forwarded as it is (greedy, seeded
        by the client, whose seed is never replaced, or not reusable anyway)."""
        if "seed" in body or reusable(body, path) or not reusable({**body, "seed": 0}, path):
            return None
        return {**body, "seed": self.rng.randrange(1 << 31)}

    def offer(
        self, target: ModelTarget, url: str, path: str, body: Mapping[str, Any],
        prompt_chars: int, ticket: Any = None, drawn: bool = False,
    ) -> bool:  # fmt: skip
        """A stable replica `url` took a request: mirror it when the step's share draws it
        (`drawn`: `draw` did already) and the canary has room; `ticket`
        (lifecycle.Ticket): the request's, whose answer the mirror waits for (and reuses
        where it can); None: mirror at once. Whether a mirror was taken."""
        split = target.canary
        if split is None or split.shadow_share <= 0:  # weight 0: the shadow step
            return False
        revisions = {e.url: e.revision for e in target.endpoints}
        if revisions.get(url) == split.revision:
            return False
        if not drawn and self.rng.random() >= split.shadow_share:
            return False
        labels = (target.served_name, target.deployment, target.namespace, split.revision)
        canaries = [e.url for e in target.routable if e.revision == split.revision]
        if not canaries:
            return self._shed(labels, "no-canary")
        if self.in_flight >= split.shadow_concurrency or self.waiting >= MAX_WAITING:
            return self._shed(labels, "busy")
        canary = min(canaries, key=self.load.load)
        if self._queued(canary):
            return self._shed(labels, "canary-queue")
        job = _Job(labels, split, url, canary, path, body, size_class(prompt_chars), ticket)
        if ticket is None:
            self._start(job, None)
        else:
            self.waiting += 1
            stream = isinstance(body, Mapping) and body.get("stream") is True
            ticket.tap = _Reference(self, job, stream, job.chat)
        return True

    def _queued(self, url: str) -> bool:
        stats = self.load.stats(url)
        return stats is not None and (stats.waiting or 0) > 0

    def _shed(self, labels: tuple[str, ...], reason: str) -> bool:
        self.metrics.shed.labels(*labels, reason).inc()
        return False

    def _ended(self, job: _Job, reference: Any | None, whole: bool) -> None:
        """The client's answer ended (`whole`: a 200 that ended whole; `reference`: it,
        parsed, when it can be reused): ask now, or shed."""
        self.waiting -= 1
        timing = getattr(job.ticket, "timing", None)
        job.tokens = getattr(timing, "chunks", 0) or 0
        if not whole:
            self._shed(job.labels, "no-reference")
        elif self.in_flight >= job.split.shadow_concurrency:
            self._shed(job.labels, "busy")
        elif self._queued(job.canary):
            self._shed(job.labels, "canary-queue")
        else:
            self._start(job, reference)

    def _start(self, job: _Job, reference: Any | None) -> None:
        if reference is None:  # the stable replica is asked too: only when it is idle
            if self.asking.get(job.stable, 0) or self.load.load(job.stable) >= 1:
                self._shed(job.labels, "stable-busy")
                return
            self.asking[job.stable] = self.asking.get(job.stable, 0) + 1
            job.asking = True
        self.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._compare(job, reference))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _compare(self, job: _Job, reference: Any | None) -> None:
        split, labels = job.split, job.labels
        limit = 2 * split.shadow_tokens
        shadow = greedy_body(job.body, job.chat, split.shadow_tokens, keep=reference is not None)
        try:
            if reference is None:
                answers = await asyncio.wait_for(asyncio.gather(
                    self._reference(job, shadow), self.post(job.canary, job.path, shadow)
                ), MIRROR_TIMEOUT)  # fmt: skip
                stable, stable_time = answers[0]
            else:
                stable, stable_time = reference, time.monotonic() - job.since
                answers = [(stable, stable_time), await asyncio.wait_for(
                    self.post(job.canary, job.path, shadow), MIRROR_TIMEOUT)]  # fmt: skip
            s_tokens, s_chosen, _, s_count = answer_tokens(stable, limit)
            c_tokens, c_chosen, c_tops, c_count = answer_tokens(answers[1][0], limit)
        except (MirrorFailed, OSError, TimeoutError, ValueError) as error:
            self._shed(labels, "failed")
            log.debug("mirror of %s failed: %s", labels[0], error)
            return
        except Exception:  # never let a mirror's failure reach anything else
            self._shed(labels, "failed")
            log.exception("mirror of %s failed", labels[0])
            return
        finally:
            self.in_flight -= 1
            self._release(job)  # cancelled before its reference ask began
        if reference is not None and s_chosen is None and c_chosen is not None:
            text = answer_text(stable)  # the client's answer has no logprobs: its text
            agree, compared, agreed = text_agreement(text, c_tokens, split.shadow_tokens,
                                                     shadow["max_tokens"],
                                                     answer_text(answers[1][0]))  # fmt: skip
            if not _has_usage(stable) and job.tokens:
                s_count = job.tokens
        else:
            agree = first_k_agree(s_tokens, c_tokens, split.shadow_tokens)
            compared, agreed = token_agreement(s_tokens, c_tokens)
        m = self.metrics
        m.compared.labels(*labels, job.size).inc()
        if agree:
            m.agreed.labels(*labels, job.size).inc()
        m.tokens.labels(*labels).inc(compared)
        m.tokens_agreed.labels(*labels).inc(agreed)
        if s_chosen is not None and c_tops is not None:
            for value in divergence(s_chosen, c_tops):
                m.divergence.labels(*labels).observe(value)
        m.stable_tpot.labels(*labels, job.size).observe(stable_time / max(s_count, 1))
        m.tpot.labels(*labels, job.size).observe(answers[1][1] / max(c_count, 1))

    async def _reference(self, job: _Job, shadow: dict[str, Any]) -> tuple[Any, float]:
        """The stable replica's greedy answer (its reference ask counted until it ends)."""
        try:
            return await self.post(job.stable, job.path, shadow)
        finally:
            self._release(job)

    def _release(self, job: _Job) -> None:
        """The reference ask on `job.stable` ended (once; a no-op after)."""
        if job.asking:
            job.asking = False
            self.asking[job.stable] -= 1
            if not self.asking[job.stable]:
                del self.asking[job.stable]

    async def aclose(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def answer_text(answer: Any) -> str:
    """The first choice's text (completions) or message content (chat)."""
    try:
        choice = answer["choices"][0]
        text = choice.get("text")
        if text is None:
            text = (choice.get("message") or {}).get("content") or ""
        return str(text)
    except (KeyError, IndexError, TypeError, AttributeError):
        raise MirrorFailed("an answer with no readable choice") from None


def _has_usage(answer: Any) -> bool:
    usage = answer.get("usage") if isinstance(answer, Mapping) else None
    return isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int)


def aiohttp_post(session_of: Callable[[], Any]) -> Post:
    """`Mirror.post` over an aiohttp session (`session_of()`): JSON in, (parsed answer,
    seconds) out, the answer bounded to MAX_ANSWER_BYTES."""
    import aiohttp

    async def post(url: str, path: str, body: dict[str, Any]) -> tuple[Any, float]:
        session = session_of()
        start = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=MIRROR_TIMEOUT)
        # the gateway's session adds no Content-Type of its own; vLLM wants it
        headers = {"x-kubellm-mirror": "1", "content-type": "application/json"}
        async with session.post(url + path, json=body, timeout=timeout, headers=headers) as r:
            if r.status != 200:
                raise MirrorFailed(f"status {r.status}")
            raw = bytearray()
            while chunk := await r.content.read(65536):
                raw += chunk
                if len(raw) > MAX_ANSWER_BYTES:
                    raise MirrorFailed(f"an answer over {MAX_ANSWER_BYTES} bytes")
        return json.loads(raw), time.monotonic() - start

    return post
