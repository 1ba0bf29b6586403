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
import json
import logging
import math
import random
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from kubellm.gateway.discovery.base import CanarySplit, ModelTarget
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


def greedy_body(body: Mapping[str, Any], chat: bool, first_tokens: int) -> dict[str, Any]:
    """The mirrored request: the client's, decoded greedily with a fixed seed, at most 2k
    tokens, not streamed, one choice, with the top logprobs of each token."""
    dropped = ("stream", "stream_options", "n", "best_of", "max_completion_tokens")
    out = {k: v for k, v in body.items() if k not in dropped}
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    wanted = 2 * first_tokens
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < wanted:
        wanted = limit
    out.update(stream=False, temperature=0, top_p=1, seed=0, n=1, max_tokens=wanted)
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


class Mirror:
    """The shadow step of one gateway: `offer` after a stable replica took a request."""

    def __init__(
        self, metrics_: MirrorMetrics, post: Post, load: LoadView, rng: random.Random | None = None
    ) -> None:
        self.metrics = metrics_
        self.post = post
        self.load = load
        self.rng = rng or random.Random()
        self.in_flight = 0
        self.tasks: set[asyncio.Task[None]] = set()

    def offer(
        self, target: ModelTarget, url: str, path: str, body: Mapping[str, Any], prompt_chars: int
    ) -> bool:
        """A stable replica `url` took a request: mirror it (in the background) when the
        step's share draws it and the canary has room. Whether a mirror was started."""
        split = target.canary
        if split is None or split.shadow_share <= 0:  # weight 0: the shadow step
            return False
        revisions = {e.url: e.revision for e in target.endpoints}
        if revisions.get(url) == split.revision or self.rng.random() >= split.shadow_share:
            return False
        labels = (target.served_name, target.deployment, target.namespace, split.revision)
        canaries = [e.url for e in target.routable if e.revision == split.revision]
        if not canaries:
            return self._shed(labels, "no-canary")
        if self.in_flight >= split.shadow_concurrency:
            return self._shed(labels, "busy")
        canary = min(canaries, key=self.load.load)
        stats = self.load.stats(canary)
        if stats is not None and (stats.waiting or 0) > 0:
            return self._shed(labels, "canary-queue")
        chat = path.endswith("chat/completions")
        shadow = greedy_body(body, chat, split.shadow_tokens)
        self.in_flight += 1
        task = asyncio.get_running_loop().create_task(
            self._compare(labels, split, (url, canary), path, shadow, size_class(prompt_chars))
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    def _shed(self, labels: tuple[str, ...], reason: str) -> bool:
        self.metrics.shed.labels(*labels, reason).inc()
        return False

    async def _compare(
        self, labels: tuple[str, ...], split: CanarySplit, urls: tuple[str, str], path: str,
        shadow: dict[str, Any], size: str,
    ) -> None:  # fmt: skip
        try:
            answers = await asyncio.wait_for(
                asyncio.gather(*(self.post(u, path, shadow) for u in urls)), MIRROR_TIMEOUT
            )
            limit = 2 * split.shadow_tokens
            (s_tokens, s_chosen, _, s_count), (c_tokens, _, c_tops, c_count) = (
                answer_tokens(a, limit) for a, _ in answers
            )
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
        m = self.metrics
        m.compared.labels(*labels, size).inc()
        if first_k_agree(s_tokens, c_tokens, split.shadow_tokens):
            m.agreed.labels(*labels, size).inc()
        compared, agreed = token_agreement(s_tokens, c_tokens)
        m.tokens.labels(*labels).inc(compared)
        m.tokens_agreed.labels(*labels).inc(agreed)
        if s_chosen is not None and c_tops is not None:
            for value in divergence(s_chosen, c_tops):
                m.divergence.labels(*labels).observe(value)
        (_, stable_time), (_, canary_time) = answers
        m.stable_tpot.labels(*labels, size).observe(stable_time / max(s_count, 1))
        m.tpot.labels(*labels, size).observe(canary_time / max(c_count, 1))

    async def aclose(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


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
