"""The gateway's view of load on each engine.

Two sources, combined conservatively:

- in-flight counts the gateway itself keeps: exact, because every routed
  request holds a release callback that is called exactly once when it ends;
- each engine's own metrics (`vllm:num_requests_waiting`, `..._running`,
  `vllm:kv_cache_usage_perc`), scraped on a short interval. They include
  traffic from other gateway replicas, but they age: stats older than
  `stale_after` seconds are treated as unknown, never trusted.

An engine whose latest scrape failed (refused, timed out, a bad answer) is `down`:
the router leaves it out while any other replica is healthy, so a replica that died
or froze is never mistaken for an idle one once its last figures go stale.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kubellm import bounded, metrics


@dataclass(frozen=True)
class EngineStats:
    """One scrape's figures; each None where the engine's figure was unusable (not a
    number, negative, infinite, or past `MAX_REQUESTS` / a KV usage outside [0, 1])."""

    waiting: float | None
    running: float | None
    kv_usage: float | None
    scraped_at: float
    tokens: float | None = None  # prompt + generated tokens so far (the replica's counters)
    # (prompt tokens computed, seconds of prefill) so far: the `local_compute` samples of
    # `vllm:prompt_tokens_by_source_total` (else, from an engine without them,
    # `vllm:prompt_tokens_total`, which counts prefix-cache hits too) and the sum of
    # `vllm:request_prefill_time_seconds`; None without both (`LoadView.prefill_rate`)
    prefill: tuple[float, float] | None = None


# A replica that says it holds more requests than this is not believed (vLLM's largest
# batches hold a few thousand; its queue is bounded by what clients sent).
MAX_REQUESTS = 1e6
# A replica's prefill speed is learnt per this many seconds of reported prefill, each
# window moving it this share of the way (`LoadView.prefill_rate`).
PREFILL_WINDOW_S = 2.0
PREFILL_EWMA = 0.5


def parse_engine_metrics(text: str, scraped_at: float) -> EngineStats:
    """Sum the request gauges over all label sets (one engine may report per model); the
    KV usage is the largest. Any sample of a family that is not a finite figure in its
    range makes that figure unknown (None): valid Prometheus text may say NaN, -5, +Inf or
    1e300, and one replica's figures must never reach the arithmetic of admission."""
    sums = {metrics.NUM_REQUESTS_WAITING: 0.0, metrics.NUM_REQUESTS_RUNNING: 0.0}
    kv = 0.0
    tokens: float | None = None
    prefill: dict[str, float] = {}  # the prompt counter and the prefill seconds, summed
    bad: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, sample.value
            counted = _COUNTED.get(name)  # the figures the sample adds to
            if name == metrics.PROMPT_TOKENS_BY_SOURCE:
                if sample.labels.get("source") != metrics.COMPUTED_SOURCE:
                    continue
                counted = (_PREFILL,)
            if counted:
                if not (math.isfinite(value) and value >= 0.0):
                    bad.update(counted)
                    continue
                if _TOKENS in counted:
                    tokens = (tokens or 0.0) + value
                if _PREFILL in counted:
                    prefill[name] = prefill.get(name, 0.0) + value
            elif name in sums:
                if 0.0 <= value <= MAX_REQUESTS:  # False for NaN
                    sums[name] += value
                else:
                    bad.add(name)
            elif name == metrics.KV_CACHE_USAGE:
                if 0.0 <= value <= 1.0:
                    kv = max(kv, value)
                else:
                    bad.add(name)

    def known(name: str, value: float, high: float) -> float | None:
        return None if name in bad or value > high else value

    return EngineStats(
        waiting=known(
            metrics.NUM_REQUESTS_WAITING, sums[metrics.NUM_REQUESTS_WAITING], MAX_REQUESTS
        ),
        running=known(
            metrics.NUM_REQUESTS_RUNNING, sums[metrics.NUM_REQUESTS_RUNNING], MAX_REQUESTS
        ),
        kv_usage=known(metrics.KV_CACHE_USAGE, kv, 1.0),
        scraped_at=scraped_at,
        tokens=None if _TOKENS in bad else tokens,
        prefill=_prefill(prefill) if _PREFILL not in bad else None,
    )


def _prefill(summed: dict[str, float]) -> tuple[float, float] | None:
    """(tokens computed, prefill seconds) from the summed counters, None without both."""
    tokens = summed.get(metrics.PROMPT_TOKENS_BY_SOURCE, summed.get(metrics.PROMPT_TOKENS))
    seconds = summed.get(_PREFILL_SUM)
    return None if tokens is None or seconds is None else (tokens, seconds)


_TOKENS = "tokens"
_PREFILL = "prefill"
_PREFILL_SUM = metrics.PREFILL_TIME + "_sum"
_COUNTED = {
    metrics.PROMPT_TOKENS: (_TOKENS, _PREFILL),
    metrics.GENERATION_TOKENS: (_TOKENS,),
    _PREFILL_SUM: (_PREFILL,),
}


# The families the gateway reads from an engine's /metrics (the load gauges, and the LoRA
# info the adapter view reads through `scrape_hooks`), and the most sample lines of them one
# answer may hold: vLLM exports a few per model, plus one per adapter set it has seen (it
# leaves old LoRA label sets exported). Parsing costs ~12 us a line, so 16 MiB of them
# would take seconds: the answer is cut to these families (in a worker thread, off the
# event loop) and refused past the line bound.
READ_FAMILIES = (
    metrics.NUM_REQUESTS_WAITING,
    metrics.NUM_REQUESTS_RUNNING,
    metrics.KV_CACHE_USAGE,
    metrics.LORA_REQUESTS_INFO,
    metrics.PROMPT_TOKENS.removesuffix("_total"),  # the family's name, and its samples'
    metrics.GENERATION_TOKENS.removesuffix("_total"),
    metrics.PROMPT_TOKENS_BY_SOURCE.removesuffix("_total"),
    _PREFILL_SUM,  # only the sum of the histogram (its buckets would cost ~20 lines each)
)
MAX_SAMPLE_LINES = 10_000


def relevant_lines(text: str, limit: int = MAX_SAMPLE_LINES) -> str:
    """The lines of `text` (with their `# TYPE`/`# HELP`) that belong to `READ_FAMILIES`;
    ValueError past `limit` sample lines (the answer is unusable, the scrape fails)."""
    keep = []
    samples = 0
    for line in text.splitlines():
        comment = line.startswith(("# TYPE ", "# HELP "))
        if (line[7:] if comment else line).startswith(READ_FAMILIES):
            keep.append(line)
            if not comment:
                samples += 1
                if samples > limit:
                    raise ValueError(f"more than {limit} samples of the load and LoRA metrics")
    return "\n".join(keep) + "\n"


class LoadView:
    """In-flight counts and the latest fresh engine stats, per endpoint URL."""

    def __init__(
        self, stale_after: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stale_after = stale_after
        self.clock = clock
        self.in_flight: dict[str, int] = {}
        self._stats: dict[str, EngineStats] = {}
        self._own_at_scrape: dict[str, int] = {}
        self._failing: set[str] = set()
        self._progress: dict[str, tuple[float, float]] = {}  # url -> (tokens, when they moved)
        self._prefill_at: dict[str, tuple[float, float]] = {}  # url -> its window's start
        self._prefill_rate: dict[str, float] = {}  # url -> prompt tokens per prefill second
        self._listeners: list[Callable[[], None]] = []
        # called with (url, metrics text) after each successful scrape (LoRA info reads it)
        self.scrape_hooks: list[Callable[[str, str], None]] = []

    def on_release(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever capacity may have freed (a release, a new scrape)."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()

    def acquire(self, url: str) -> Callable[[], None]:
        """Count one request on `url`; the returned callback releases it (idempotent)."""
        self.in_flight[url] = self.in_flight.get(url, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.in_flight[url] -= 1
            if self.in_flight[url] <= 0:
                del self.in_flight[url]
            self._notify()

        return release

    def record(self, url: str, stats: EngineStats) -> None:
        self._failing.discard(url)
        if stats.tokens is None:
            self._progress.pop(url, None)
        else:
            seen = self._progress.get(url)
            if seen is None or seen[0] != stats.tokens:
                self._progress[url] = (stats.tokens, stats.scraped_at)
        self._learn_prefill(url, stats.prefill)
        self._stats[url] = stats
        self._own_at_scrape[url] = self.in_flight.get(url, 0)
        self._notify()

    def _learn_prefill(self, url: str, prefill: tuple[float, float] | None) -> None:
        """Each window of `PREFILL_WINDOW_S` seconds of prefill the replica reports moves
        its prefill speed `PREFILL_EWMA` of the way to that window's prompt tokens per
        second (vLLM counts a prompt at its first token and its prefill time at its end:
        a window of many requests evens them out); counters that went back restart it."""
        if prefill is None:
            return
        start = self._prefill_at.get(url)
        if start is None or prefill[0] < start[0] or prefill[1] < start[1]:
            self._prefill_at[url] = prefill
            return
        tokens, seconds = prefill[0] - start[0], prefill[1] - start[1]
        if seconds < PREFILL_WINDOW_S or tokens <= 0:
            return
        old = self._prefill_rate.get(url)
        rate = tokens / seconds
        self._prefill_rate[url] = rate if old is None else old + PREFILL_EWMA * (rate - old)
        self._prefill_at[url] = prefill

    def prefill_rate(self, url: str) -> float | None:
        """The replica's prefill speed learnt from its scrapes (prompt tokens per second of
        a request's prefill), None until a window of it was seen."""
        return self._prefill_rate.get(url)

    def scrape_failed(self, url: str) -> None:
        """The latest scrape of `url` failed: it is down until one succeeds."""
        self._failing.add(url)

    def down(self, url: str) -> bool:
        """The latest scrape failed (an endpoint never scraped yet is not down)."""
        return url in self._failing

    def progressed_since(self, url: str, since: float) -> bool | None:
        """Whether the replica's token counters moved at a scrape at or after `since` (this
        view's clock); None when they are not known (never scraped, or no such counters).
        A replica whose scrapes fail keeps its last movement: a frozen process stands still."""
        seen = self._progress.get(url)
        return None if seen is None else seen[1] >= since

    def stats(self, url: str) -> EngineStats | None:
        """The engine's stats if fresh, else None (unknown)."""
        stats = self._stats.get(url)
        if stats is None or self.clock() - stats.scraped_at > self.stale_after:
            return None
        return stats

    def load(self, url: str) -> float:
        """Requests on the engine: its reported running + waiting, moved by what this
        gateway sent or saw finish since that scrape, and never below our own count.

        The correction keeps a scrape that is a fraction of a second old from
        hiding a burst this gateway just sent; with several gateways each corrects
        by its own share, so their views of a replica stay close.
        """
        return self.load_of(url, self.in_flight.get(url, 0), self.stats(url))

    def load_of(self, url: str, own: int, stats: EngineStats | None) -> float:
        """`load(url)` from the figures a caller read already: `own`, its in-flight count
        here, and `stats`, its `stats(url)`."""
        if stats is None or stats.running is None or stats.waiting is None:
            return float(own)
        since = own - self._own_at_scrape.get(url, 0)
        return max(float(own), stats.running + stats.waiting + since)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop stats of endpoints no longer known (in-flight counts drain on their own)."""
        keep = set(keep)
        for url in [u for u in self._stats if u not in keep]:
            del self._stats[url]
            self._own_at_scrape.pop(url, None)
        for url in [u for u in self._progress if u not in keep]:
            del self._progress[url]
        for url in [u for u in self._prefill_at if u not in keep]:
            del self._prefill_at[url]
            self._prefill_rate.pop(url, None)
        self._failing &= keep


_SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)  # the whole answer, body included


async def read_answer(
    client: aiohttp.ClientSession, url: str, limit: int = bounded.MAX_ANSWER_BYTES
) -> bytes:
    """GET `url`'s body within `_SCRAPE_TIMEOUT` (the whole answer) and at most `limit` bytes
    (the core's bounded reader: a replica answering gigabytes costs the gateway `limit`).
    Raises aiohttp.ClientError, TimeoutError or bounded.AnswerTooLarge (a ValueError)."""
    async with client.get(url, timeout=_SCRAPE_TIMEOUT) as response:
        response.raise_for_status()
        return await bounded.read_capped(
            response.content.iter_any(), limit, response.content_length
        )


def _parse(body: bytes, scraped_at: float) -> tuple[str, EngineStats]:
    text = relevant_lines(body.decode("utf-8"))
    return text, parse_engine_metrics(text, scraped_at)


async def scrape_once(client: aiohttp.ClientSession, url: str, view: LoadView) -> bool:
    try:
        body = await read_answer(client, f"{url}/metrics")
        text, stats = await asyncio.to_thread(_parse, body, view.clock())
        view.record(url, stats)
        for hook in view.scrape_hooks:
            hook(url, text)
        return True
    except (TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError):
        view.scrape_failed(url)  # down until a scrape succeeds; its old stats go stale
        return False


async def scrape_loop(
    client: aiohttp.ClientSession,
    urls: Callable[[], Iterable[str]],
    view: LoadView,
    interval: float = 1.0,
) -> None:
    """Scrape every known engine each `interval` seconds, concurrently, until cancelled."""
    while True:
        current = sorted(set(urls()))
        view.forget(current)
        await asyncio.gather(*(scrape_once(client, u, view) for u in current))
        await asyncio.sleep(interval)
