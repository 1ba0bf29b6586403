"""The simulator's runtime: the asyncio task that steps `sim_core.Engine`, and its metrics.

One task steps the engine: it runs a step, waits the step's simulated duration
(times the time scale), then hands each request its new tokens. HTTP handlers
(sim_server) only submit requests and read their tokens. Latency histograms are
in simulated seconds, so they do not depend on the time scale.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kubellm.engine import sim_profiles as profiles
from kubellm.engine import sim_tiers
from kubellm.engine import sim_tokenizer as tokenizer
from kubellm.engine.sim_core import WAITING, Engine, Request, StepResult
from kubellm.engine.sim_events import KVEventPublisher
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kubellm import metrics

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


SIM_LORA_LOADS = "kubellm_sim_lora_loads_total"


class RequestRejected(ValueError):
    """A request the engine can never run (too long for the context or the KV pool)."""


class Clock:
    """Simulated time: wall time / scale, or (scale 0) a counter advanced by steps."""

    def __init__(self, scale: float) -> None:
        if scale < 0:
            raise ValueError(f"--time-scale must be >= 0, got {scale}")
        self.scale = scale
        self._start = time.monotonic()
        self._virtual = 0.0

    def now(self) -> float:
        if self.scale > 0:
            return (time.monotonic() - self._start) / self.scale
        return self._virtual

    async def sleep_until(self, when: float) -> None:
        if self.scale > 0:
            await asyncio.sleep(max(0.0, (when - self.now()) * self.scale))
        else:
            self._virtual = max(self._virtual, when)
            await asyncio.sleep(0)


@dataclass
class _Stream:
    """What one HTTP request waits on: its engine request and the tokens not yet read.

    A streaming reader is woken after every step that gave it a token; a
    non-streaming one only when the request finishes (cheaper under load).
    """

    request: Request
    arrival: float
    streaming: bool = True
    pending: list[int] = field(default_factory=list)
    finished: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    last: float | None = None
    scheduled: float | None = None  # when a step first took it in (simulated s)
    prefill: float = 0.0  # first scheduled to first token (simulated s)


class Simulator:
    """The engine, its stepping task, and its Prometheus metrics."""

    def __init__(
        self,
        served_model_name: str,
        profile: profiles.Profile,
        time_scale: float,
        tok: tokenizer.Tokenizer,
        publisher: KVEventPublisher | None = None,
        role: str | None = None,
    ) -> None:
        self.served_model_name = served_model_name
        self.profile = profile
        self.tokenizer = tok
        self.clock = Clock(time_scale)
        # KV events (spec.routing.prefixIndex precise): each step's batch, published
        self.publisher = publisher
        self.engine = Engine(profile, vocab_size=tok.vocab_size, kv_events=publisher is not None)
        # P/D (spec.prefill): "prefill" answers kv_transfer_params, "decode" takes them
        self.role = role
        self.engine_id = uuid.uuid4().hex
        self.engine.kv_connector = self.engine.kv_connector or role is not None
        self.streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry()
        labels = {"model_name": served_model_name, "engine": "0"}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        self.g_running = gauge(metrics.NUM_REQUESTS_RUNNING, "Requests in the running batch.")
        self.g_waiting = gauge(metrics.NUM_REQUESTS_WAITING, "Requests waiting to be admitted.")
        self.g_kv = gauge(metrics.KV_CACHE_USAGE, "KV-cache usage; 1 means 100 percent.")

        def counter(name: str, doc: str) -> Counter:
            return Counter(name.removesuffix("_total"), doc, names, registry=self.registry).labels(
                **labels
            )

        self.c_queries = counter(metrics.PREFIX_CACHE_QUERIES, "Prefix cache queries, in tokens.")
        self.c_hits = counter(metrics.PREFIX_CACHE_HITS, "Prefix cache hits, in tokens.")
        # As vLLM's: every prompt token, counted once per request at its first token, and
        # the same tokens by source (computed here, this replica's cache, a KV connector).
        self.c_prompt = counter(metrics.PROMPT_TOKENS, "Number of prefill tokens processed.")
        by_source = Counter(
            metrics.PROMPT_TOKENS_BY_SOURCE.removesuffix("_total"),
            "Number of prompt tokens by source.", [*names, "source"], registry=self.registry,
        )  # fmt: skip
        self.c_source = {
            source: by_source.labels(**labels, source=source)
            for source in (metrics.COMPUTED_SOURCE, "local_cache_hit", "external_kv_transfer")
        }
        self.c_generation = counter("vllm:generation_tokens_total", "Generated tokens.")
        self.c_preemptions = counter("vllm:num_preemptions_total", "Preempted requests.")
        self.c_success = counter("vllm:request_success_total", "Finished requests.")
        self.h_ttft = Histogram(
            metrics.TIME_TO_FIRST_TOKEN, "Time to first token (simulated seconds).", names,
            buckets=TTFT_BUCKETS, registry=self.registry,
        ).labels(**labels)  # fmt: skip
        # vLLM's per-request prefill time (first scheduled to first token), observed at the
        # request's end. In wall seconds (simulated x --time-scale; scale 0: simulated), as
        # vLLM's: the gateway learns each replica's prefill speed from it and paces by its
        # own clock (gateway/routing/gates/flow.py).
        self.h_prefill = Histogram(
            metrics.PREFILL_TIME, "Prefill time per request (wall seconds).", names,
            buckets=TTFT_BUCKETS, registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self._unscheduled: dict[str, _Stream] = {}  # submitted, no step took them in yet
        self.h_itl = Histogram(
            metrics.INTER_TOKEN_LATENCY, "Inter-token latency (simulated seconds).", names,
            buckets=ITL_BUCKETS, registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self._counted = (0, 0, 0)
        # KV offload tiers: vLLM's offload counters (sim_tiers.metric_values)
        self._offload: dict[tuple[str, str | None], tuple[Counter, float]] = {}
        if self.engine.tiers is not None:
            values = sim_tiers.metric_values(self.engine.tiers, 0, 0)
            disk = bool(self.engine.tiers.capacity["STORAGE"])
            made: dict[str, Counter] = {}
            for name, tier in values:
                if tier is not None and not disk:
                    continue
                if name not in made:
                    extra = ["tier"] if tier is not None else []
                    made[name] = Counter(name, name, [*names, *extra], registry=self.registry)
                metric = made[name]
                child = metric.labels(**labels, **({"tier": tier} if tier else {}))
                self._offload[(name, tier)] = (child, 0.0)
        # LoRA: the registered adapters (name -> path), as vLLM's /v1/models lists them, and
        # vLLM's info gauge: one series per (max, waiting, running) label set, set to the
        # time it was last current; older sets stay exported with older times, as in vLLM.
        self.adapters: dict[str, str] = {}
        self.lora_info = (
            Gauge(
                metrics.LORA_REQUESTS_INFO, "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )
            if profile.max_loras
            else None
        )  # fmt: skip
        # The simulator's own (vLLM has no such counter): adapters loaded into a slot, for
        # benchmarks that count swaps (bench/lora_routing.py).
        self.c_lora_loads = (
            Counter(SIM_LORA_LOADS.removesuffix("_total"), "Adapters loaded into a LoRA slot.",
                    registry=self.registry)
            if profile.max_loras
            else None
        )  # fmt: skip
        self._lora_loads_counted = 0
        # a P/D role's connector counts as vLLM's does (the offload tiers' export them too)
        self._external = (
            (counter(sim_tiers.EXTERNAL_QUERIES, "External prefix cache queries, in tokens."),
             counter(sim_tiers.EXTERNAL_HITS, "External prefix cache hits, in tokens."), [0, 0])
            if role is not None and self.engine.tiers is None
            else None
        )  # fmt: skip

    # ------------------------------------------------------------------ the stepping task

    def _ensure_started(self) -> None:
        if self.publisher is not None:
            self.publisher.start()
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.publisher is not None:
            await self.publisher.stop()

    def publish_events(self) -> None:
        """Send the KV events of the steps run since the last call as one batch."""
        if self.publisher is not None:
            events = self.engine.take_events()
            if events:
                self.publisher.publish(events)

    async def _loop(self) -> None:
        """Step while there is work. While busy, simulated time advances by exactly the
        step durations (Python overhead does not leak into latencies); after an idle
        spell it resumes from the clock."""
        assert self._wake is not None
        cursor = self.clock.now()
        while True:
            if not self.engine.has_work:
                self._wake.clear()
                await self._wake.wait()
                cursor = max(cursor, self.clock.now())
                continue
            started = cursor
            result = self.engine.step()
            self._mark_scheduled(started)
            if result.idle:  # nothing could be scheduled: wait for a change
                self._wake.clear()
                await self._wake.wait()
                cursor = max(cursor, self.clock.now())
                continue
            cursor += result.duration
            await self.clock.sleep_until(cursor)
            self.publish_events()  # as vLLM: after the step ran, before its outputs
            self._deliver(result, cursor)

    def _mark_scheduled(self, when: float) -> None:
        """Stamp the requests a step took in for the first time (vLLM's scheduled_ts), in
        arrival order up to the first still waiting (the engine takes them in that order;
        one it passed over is stamped with those after it: a step deep queues do not pay
        for)."""
        while self._unscheduled:
            rid, stream = next(iter(self._unscheduled.items()))
            if stream.request.status == WAITING:
                return
            stream.scheduled = when
            del self._unscheduled[rid]

    def _count_prompt(self, request: Request) -> None:
        """A request's prompt tokens, counted at its first token as vLLM counts them."""
        prompt = len(request.prompt)
        cached = prompt - max(prompt - request.cached_tokens, 1)  # the last one is computed
        local = min(request.local_cached, cached)
        self.c_prompt.inc(prompt)
        self.c_source[metrics.COMPUTED_SOURCE].inc(prompt - cached)
        self.c_source["local_cache_hit"].inc(local)
        self.c_source["external_kv_transfer"].inc(cached - local)

    def _deliver(self, result: StepResult, when: float) -> None:
        """Hand each request its token (stamped with the step's end) and record latencies."""
        self.c_generation.inc(len(result.tokens))
        for request, token in result.tokens:
            stream = self.streams.get(request.request_id)
            if stream is None:
                continue
            if stream.last is None:  # arrival is on the clock; `when` may lag it a little
                self._count_prompt(request)
                self.h_ttft.observe(max(0.0, when - stream.arrival))
                started = when if stream.scheduled is None else stream.scheduled
                stream.prefill = max(0.0, when - started)
            else:
                self.h_itl.observe(when - stream.last)
            stream.last = when
            stream.pending.append(token)
            if stream.streaming:
                stream.changed.set()
        for request in result.finished:
            self.c_success.inc()
            stream = self.streams.get(request.request_id)
            if stream is not None:
                self.h_prefill.observe(stream.prefill * (self.clock.scale or 1.0))
                stream.finished = True
                stream.changed.set()

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt_tokens: list[int],
        max_tokens: int,
        streaming: bool = True,
        lora: str | None = None,
        cache_salt: str | None = None,
        remote_kv: bool = False,
    ) -> _Stream:
        reason = self.engine.validate(len(prompt_tokens), max_tokens)
        if reason:
            raise RequestRejected(reason)
        self._ensure_started()
        request = Request(
            f"sim-{next(self._ids)}", list(prompt_tokens), max_tokens, lora=lora,
            lora_path=self.adapters.get(lora, "") if lora else "", cache_salt=cache_salt,
            remote_kv=remote_kv,
        )  # fmt: skip
        stream = _Stream(request, self.clock.now(), streaming)
        self.streams[request.request_id] = stream
        self._unscheduled[request.request_id] = stream
        self.engine.add(request)
        assert self._wake is not None
        self._wake.set()
        return stream

    def kv_transfer_params(self, stream: _Stream, host: str, port: int) -> dict[str, object]:
        """A prefill role's answer naming the finished request's KV blocks, as vLLM's
        NixlConnector gives it (request_finished): the decode role pulls them with these."""
        request = stream.request
        hashes = request._lookup[1] if request._lookup else []
        cached = (self.engine.pool.cached.get(h) for h in hashes)
        return {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [b for b in cached if b is not None],
            "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
            "remote_host": host, "remote_port": port, "tp_size": 1,
        }  # fmt: skip

    async def receive_kv(self, prompt_tokens: list[int], cache_salt: str | None) -> None:
        """Wait while a prefill role's KV for the prompt's part not cached here crosses the
        link (vLLM's NIXL pulls it before the request is scheduled; other requests step on)."""
        missing = len(prompt_tokens) - self.engine.cached_prefix_tokens(prompt_tokens, cache_salt)
        await self.clock.sleep_until(
            self.clock.now() + self.profile.kv_transfer_seconds(max(0, missing))
        )

    async def tokens(self, stream: _Stream) -> AsyncIterator[str]:
        """The text pieces of a request as they are generated; aborts it if abandoned."""
        completed = False
        try:
            while True:
                if stream.pending:
                    batch, stream.pending = stream.pending, []
                    for token in batch:
                        yield self.tokenizer.decode_one(token)
                    continue
                if stream.finished:
                    completed = True
                    return
                stream.changed.clear()
                await stream.changed.wait()
        finally:
            self.streams.pop(stream.request.request_id, None)
            self._unscheduled.pop(stream.request.request_id, None)
            if not completed:
                self.engine.abort(stream.request)

    # ------------------------------------------------------------------ metrics

    def render_metrics(self) -> bytes:
        self.g_running.set(len(self.engine.running))
        self.g_waiting.set(len(self.engine.waiting))
        self.g_kv.set(self.engine.kv_cache_usage())
        now = (self.engine.prefix_queries, self.engine.prefix_hits, self.engine.preemptions)
        self.c_queries.inc(now[0] - self._counted[0])
        self.c_hits.inc(now[1] - self._counted[1])
        self.c_preemptions.inc(now[2] - self._counted[2])
        self._counted = now
        if self.engine.tiers is not None:
            values = sim_tiers.metric_values(
                self.engine.tiers, self.engine.external_queries, self.engine.external_hits
            )
            for key, (child, counted) in self._offload.items():
                child.inc(values[key] - counted)
                self._offload[key] = (child, values[key])
        if self._external is not None:
            queries, hits, counted = self._external
            queries.inc(self.engine.external_queries - counted[0])
            hits.inc(self.engine.external_hits - counted[1])
            counted[:] = [self.engine.external_queries, self.engine.external_hits]
        if self.c_lora_loads is not None:
            self.c_lora_loads.inc(self.engine.lora_loads - self._lora_loads_counted)
            self._lora_loads_counted = self.engine.lora_loads
        if self.lora_info is not None:
            running, waiting = self.engine.lora_adapters()
            self.lora_info.labels(
                max_lora=str(self.profile.max_loras),
                waiting_lora_adapters=",".join(waiting),
                running_lora_adapters=",".join(running),
            ).set(time.time())
        return generate_latest(self.registry)
