"""Precise prefix routing against two real vLLM CPU engines, started through the launcher
with spec.routing.prefixIndex precise (so the launcher turns their KV events on) and a
small KV pool each:

- the block hashes the gateway computes for a prompt equal those in the BlockStored
  events vLLM publishes for it (completions, token ids, chat with the model's template);
- evicting a prefix on one replica moves its next request elsewhere in precise mode (to
  the replica whose events still show it, where vLLM's counters then count a hit) and not
  in approximate mode (which still trusts what the gateway sent).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubellm.gateway.discovery.base import Endpoint, ModelTarget
from kubellm.gateway.routing.index.kv_events import EventAddress, KVEventsSubscriber, KVIndex
from kubellm.gateway.routing.index.kv_hashes import BlockHasher, PromptTokenizer
from kubellm.gateway.routing.index.precise_routing import PreciseRouting
from kubellm.gateway.routing.replicas.load import LoadView
from kubellm.gateway.routing.replicas.outliers import OutlierDetector
from kubellm.gateway.routing.router import Router, home, routing_request
from prometheus_client.parser import text_string_to_metric_families

from kubellm import metrics
from kubellm.api import Routing
from tests.fixtures.engines import VllmStart, running_vllms, tiny_spec, wait_until
from tests.fixtures.polling import eventually

pytestmark = pytest.mark.vllm

# 40 blocks of 32 tokens (1,280 tokens; the model's length limit is 1,024): a few prompts
# of ~20 blocks evict the least recently used ones.
POOL_BLOCKS = 40
BLOCK_SIZE = 32


def events_spec(model_dir: Path, kv_events_port: int) -> dict[str, Any]:
    spec = tiny_spec(model_dir)
    spec["engine"]["maxNumSeqs"] = 4
    spec["engine"]["extraArgs"] += ["--num-gpu-blocks-override", str(POOL_BLOCKS)]
    spec["routing"] = {"prefixIndex": "precise", "kvEventsPort": kv_events_port}
    return spec


def _port_pair() -> int:
    """A free port whose successor is free too (the publisher and its replay socket), below
    Linux's ephemeral range: vLLM takes free ports from that range for its own sockets
    while it starts, and could otherwise take the replay port before its publisher binds."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20_000, 30_000, 2)
        try:
            with socket.socket() as one, socket.socket() as two:
                one.bind(("127.0.0.1", port))
                two.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports")


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[tuple[str, int]]]:
    """Two vLLM engines with KV events on: [(URL, events port), ...]."""
    ports = [_port_pair() for _ in range(2)]
    starts = [VllmStart(events_spec(tiny_model_dir, port), tmp_path_factory.mktemp("vllm"))
              for port in ports]  # fmt: skip
    with running_vllms(starts) as urls:
        yield list(zip(urls, ports, strict=True))


class _Events:
    """A SUB socket on one engine's publisher collecting BlockStored hashes."""

    def __init__(self, port: int) -> None:
        import zmq

        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.stored: list[int] = []

    def drain(self) -> None:
        import msgspec

        while self.socket.poll(0):
            _, _, payload = self.socket.recv_multipart()
            for event in msgspec.msgpack.decode(payload)[1]:
                if event["type"] == "BlockStored":
                    self.stored += event["block_hashes"]


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    route = "chat/completions" if "messages" in body else "completions"
    answer = httpx.post(f"{url}/v1/{route}", json={"max_tokens": 1, **body}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


WORDS = "the quick brown fox jumps over the lazy dog while seven rivers run to the sea "


def test_gateway_hashes_equal_the_block_stored_events_of_real_vllm(
    engines: list[tuple[str, int]], tiny_model_dir: Path
) -> None:
    url, port = engines[0]
    tokenizer = PromptTokenizer(tiny_model_dir)
    hasher = BlockHasher(BLOCK_SIZE)
    events = _Events(port)
    try:
        marker = 0

        def connected() -> bool:  # ZMQ's slow joiner: the first messages may be missed
            nonlocal marker
            marker += 1
            _complete(url, {"model": "tiny", "prompt": f"warm {marker} " + "pebbles " * 40})
            events.drain()
            return bool(events.stored)

        wait_until(connected, 30, "the first KV event", interval=0.2)
        bodies: list[dict[str, Any]] = [
            {"model": "tiny", "prompt": "alpha " + WORDS * 8},
            {"model": "tiny", "prompt": list(range(5, 5 + BLOCK_SIZE * 3 + 5))},
            {"model": "tiny", "messages": [
                {"role": "system", "content": "beta " + WORDS * 6},
                {"role": "user", "content": "and what then?"}]},
            {"model": "tiny", "messages": [
                {"role": "system", "content": "gamma " + WORDS * 3},
                {"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": WORDS * 2}]},
        ]  # fmt: skip
        for body in bodies:
            events.drain()
            events.stored.clear()
            usage = _complete(url, body)["usage"]
            token_ids = tokenizer.token_ids(body)
            assert token_ids is not None and len(token_ids) == usage["prompt_tokens"]
            expected = list(hasher.block_hashes(token_ids))
            assert len(expected) >= 3
            deadline = time.monotonic() + 10
            while len(events.stored) < len(expected) and time.monotonic() < deadline:
                events.socket.poll(200)
                events.drain()
            assert events.stored[: len(expected)] == expected, json.dumps(body)[:120]
    finally:
        events.socket.close(linger=0)


def _counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


async def test_evicting_a_prefix_moves_its_next_request_in_precise_mode_only(
    engines: list[tuple[str, int]], tiny_model_dir: Path
) -> None:
    (a, a_port), (b, b_port) = engines
    ports = {a: a_port, b: b_port}
    index = KVIndex()
    subscriber = KVEventsSubscriber(index, probe_interval=0.2, probe_timeout=2.0)
    precise = PreciseRouting(
        {"tiny": str(tiny_model_dir)},
        index=index,
        subscriber=subscriber,
        address_of=lambda _t, e: EventAddress(
            f"tcp://127.0.0.1:{ports[e.url]}", f"tcp://127.0.0.1:{ports[e.url] + 1}"
        ),
    )
    router = Router(LoadView(), OutlierDetector(3, 5.0), precise=precise)

    def target(mode: str) -> ModelTarget:
        return ModelTarget(served_name="tiny", deployment="tiny",
                           endpoints=(Endpoint(a), Endpoint(b)),
                           routing=Routing(prefix_index=mode))  # fmt: skip

    def first(mode: str, body: dict[str, Any]) -> str:
        request = routing_request("tiny", body, None)
        t = target(mode)
        return router.order(t, request, router.candidates(t))[0].url

    body = {"model": "tiny", "messages": [
        {"role": "system", "content": "You are the tenant's assistant. " + WORDS * 6},
        {"role": "user", "content": "Summarise the policy."}]}  # fmt: skip
    hashes = BlockHasher(BLOCK_SIZE).block_hashes(PromptTokenizer(tiny_model_dir).token_ids(body))
    full = len(hashes)
    precise.prepare({"tiny": target("precise")})
    subscriber.sync(precise.wanted({"tiny": target("precise")}))
    try:
        await eventually(lambda: subscriber.fresh(a) and subscriber.fresh(b), 30, "fresh events")
        # The gateway sends the prefix to A (its approximate index records that); another
        # gateway sent it to B as well. A is the prompt's home (rendezvous order of the two
        # URLs, whose ports are random): a first-seen prompt is indexed only there.
        request = routing_request("tiny", body, None)
        if home(request, [a, b]) != a:
            a, b = b, a
        await asyncio.to_thread(_complete, a, body)
        router.routed(request, a, [a, b])
        await asyncio.to_thread(_complete, b, body)
        await eventually(lambda: index.matched(a, hashes) == full == index.matched(b, hashes),
                     30, "both replicas' events to show the prefix")  # fmt: skip
        assert first("approximate", body) == a
        # Other tenants' long prompts fill A's small pool: vLLM evicts the prefix there.
        tokenizer, hasher = PromptTokenizer(tiny_model_dir), BlockHasher(BLOCK_SIZE)
        n = 0
        while index.matched(a, hashes) == full:
            n += 1
            assert n <= 8, "vLLM did not evict the prefix on A"
            other = {"model": "tiny", "prompt": f"tenant {n} " + "lanterns glow " * 60}
            theirs = hasher.block_hashes(tokenizer.token_ids(other) or [])
            await asyncio.to_thread(_complete, a, other)
            # vLLM publishes an eviction before the store that needed the room
            await eventually(lambda t=theirs: index.matched(a, t) == len(t), 30, "A's new blocks")
        assert first("approximate", body) == a  # still trusts what it sent
        chosen = first("precise", body)
        assert chosen == b  # where the prefix still is
        hits = _counter(b, metrics.PREFIX_CACHE_HITS)
        await asyncio.to_thread(_complete, chosen, body)
        assert _counter(b, metrics.PREFIX_CACHE_HITS) - hits >= (full - 1) * BLOCK_SIZE
    finally:
        await subscriber.close()
