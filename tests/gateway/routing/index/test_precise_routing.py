"""Precise prefix routing in the router: the replica whose KV events show the prompt's
blocks wins in precise mode; approximate mode keeps trusting what the gateway sent; a
replica with stale events, or a prompt that cannot be hashed, is scored approximately and
counted."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from kubellm.gateway.discovery.base import Endpoint, ModelTarget
from kubellm.gateway.routing.index.kv_events import KVEventsSubscriber, KVIndex
from kubellm.gateway.routing.index.kv_hashes import BlockHasher, PromptTokenizer
from kubellm.gateway.routing.index.precise_routing import PreciseRouting
from kubellm.gateway.routing.replicas.load import LoadView
from kubellm.gateway.routing.replicas.outliers import OutlierDetector
from kubellm.gateway.routing.router import Router, routing_request
from prometheus_client import CollectorRegistry

from kubellm.api import Routing

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
BLOCK = 32
BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You answer tersely. " * 40},
        {"role": "user", "content": "What is a KV cache?"},
    ],
}


class Freshness(KVEventsSubscriber):
    """The subscriber's verdict, set by the test (its I/O is tested in test_kv_index.py)."""

    stale: set[str] = set()

    def fresh(self, url: str) -> bool:
        return url not in self.stale


def target(prefix_index: str) -> ModelTarget:
    return ModelTarget(
        served_name="tiny",
        deployment="tiny",
        endpoints=(Endpoint(A), Endpoint(B)),
        routing=Routing(prefix_index=prefix_index),
    )


def setup(tiny_model_dir: Path, tokenizers: bool = True) -> tuple[Router, Freshness, Any]:
    """A router whose approximate index says A holds BODY's prefix (the gateway sent it
    there, a minute ago) while the engines' events say only B holds it (A evicted it)."""
    index = KVIndex()
    fresh = Freshness(index)
    fresh.stale = set()
    registry = CollectorRegistry()
    precise = PreciseRouting(
        {"tiny": str(tiny_model_dir)} if tokenizers else {},
        index=index,
        subscriber=fresh,
        registry=registry,
    )
    precise.prepare({"tiny": target("precise")})
    router = Router(LoadView(), OutlierDetector(3, 5.0), precise=precise)
    request = routing_request("tiny", BODY, None)
    now = router.index.clock()
    router.index.clock = lambda: now - 60.0
    router.index.record(A, request.chunk_hashes)
    router.index.clock = lambda: now
    router.sharing.observe("tiny", request.chunk_hashes[0])
    token_ids = PromptTokenizer(tiny_model_dir).token_ids(BODY)
    assert token_ids is not None
    hashes = BlockHasher(BLOCK).block_hashes(token_ids)
    stored = {"type": "BlockStored", "block_hashes": list(hashes), "block_size": BLOCK}
    index.apply(B, 0, [0.0, [stored], 0])
    index.apply(A, 0, [0.0, [{"type": "BlockStored", "block_hashes": [7], "block_size": BLOCK}]])
    return router, fresh, registry


def first(router: Router, prefix_index: str) -> str:
    t = target(prefix_index)
    request = routing_request("tiny", BODY, None)
    return router.order(t, request, router.candidates(t))[0].url


def fallbacks(registry: Any, reason: str) -> float:
    value = registry.get_sample_value(
        "kubellm_gateway_prefix_index_fallbacks_total", {"model": "tiny", "reason": reason}
    )
    return value or 0.0


def test_precise_mode_follows_the_engines_events(tiny_model_dir: Path) -> None:
    router, _, registry = setup(tiny_model_dir)
    assert first(router, "precise") == B
    assert first(router, "approximate") == A  # still trusts what it sent
    assert fallbacks(registry, "stale") == 0


def test_a_prefix_sent_moments_ago_counts_until_its_events_can_announce_it(
    tiny_model_dir: Path,
) -> None:
    """Events lag the routing decision (the engine announces blocks after admitting the
    request and running a step): a prefix this gateway sent to A within RECENT_S seconds
    scores as held there, so a burst of one prompt does not scatter before the first
    one's blocks are announced; past that window the events alone decide."""
    from kubellm.gateway.routing.scorers.base import Candidate
    from kubellm.gateway.routing.scorers.precise import RECENT_S, PrecisePrefixScorer

    router, fresh, _ = setup(tiny_model_dir)
    assert router.precise is not None
    scorer = PrecisePrefixScorer(router.precise.index, fresh.fresh, router.index)
    request = routing_request("tiny", BODY, None)
    request = request._replace(kv_hashes=router.precise.kv_hashes(target("precise"), BODY))
    candidates = [Candidate(url=A, load=0.0), Candidate(url=B, load=0.0)]
    assert scorer.score(request, candidates) == [0.0, 1.0]  # sent a minute ago: evicted
    now = router.index.clock()
    router.index.record(A, request.chunk_hashes)  # sent again just now
    assert scorer.score(request, candidates) == [1.0, 1.0]
    router.index.clock = lambda: now + RECENT_S + 0.1  # its events had time to say
    assert scorer.score(request, candidates) == [0.0, 1.0]


def test_a_removal_announced_after_a_send_ends_its_credit_at_once(tiny_model_dir: Path) -> None:
    """Within RECENT_S of a send, a removal the replica announces afterwards is newer than
    the send: the events decide again (an eviction right after a send is believed)."""
    from kubellm.gateway.routing.scorers.base import Candidate
    from kubellm.gateway.routing.scorers.precise import PrecisePrefixScorer

    router, fresh, _ = setup(tiny_model_dir)
    assert router.precise is not None
    kv = router.precise.index
    scorer = PrecisePrefixScorer(kv, fresh.fresh, router.index)
    request = routing_request("tiny", BODY, None)
    request = request._replace(kv_hashes=router.precise.kv_hashes(target("precise"), BODY))
    candidates = [Candidate(url=A, load=0.0), Candidate(url=B, load=0.0)]
    sent = router.index.clock()
    router.index.record(A, request.chunk_hashes)  # sent just now
    assert scorer.score(request, candidates) == [1.0, 1.0]
    kv.clock = lambda: sent + 0.5  # A announces a removal half a second later
    removed = {"type": "BlockRemoved", "block_hashes": [7]}
    kv.apply(A, kv.next_seq(A) or 0, [0.0, [removed], 0])
    assert kv.removed_at(A) == sent + 0.5
    router.index.clock = lambda: sent + 1.0  # still within RECENT_S of the send
    assert scorer.score(request, candidates) == [0.0, 1.0]


def test_a_replica_with_stale_events_is_scored_approximately_and_counted(
    tiny_model_dir: Path,
) -> None:
    router, fresh, registry = setup(tiny_model_dir)
    fresh.stale = {B}  # B's events cannot be trusted: its approximate score (0) counts
    first(router, "precise")
    assert fallbacks(registry, "stale") == 1
    fresh.stale = {A, B}  # nothing fresh: the approximate view (A) decides again
    assert first(router, "precise") == A
    assert fallbacks(registry, "stale") == 3


def test_without_a_tokenizer_every_replica_is_scored_approximately(
    tiny_model_dir: Path,
) -> None:
    router, _, registry = setup(tiny_model_dir, tokenizers=False)
    assert first(router, "precise") == A
    assert fallbacks(registry, "unhashed") == 2


def test_the_block_size_comes_from_the_events(tiny_model_dir: Path) -> None:
    router, _, _ = setup(tiny_model_dir)
    assert router.precise is not None
    assert router.precise.block_size(target("precise")) == BLOCK
    assert router.precise.block_size(ModelTarget(served_name="x", deployment="x")) is None


def test_an_hf_model_s_tokenizer_comes_from_its_own_repository_unless_a_flag_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No --tokenizer for an hf:// model: its repository and revision, as the engines load
    it (transformers is not asked here: the loader is replaced, nothing is downloaded). A
    flag wins; a pvc:// model without a flag has none (scored approximately)."""
    from kubellm.gateway.routing.index import precise_routing as module

    loaded: list[tuple[str, str | None]] = []

    def loader(path: str, revision: str | None = None) -> Any:
        loaded.append((path, revision))
        return object()

    monkeypatch.setattr(module, "load_tokenizer", loader)
    routing = Routing(prefix_index="precise")

    def model(name: str, source: str) -> ModelTarget:
        return ModelTarget(name, name, routing=routing, model_source=source)

    targets = {
        "a": model("a", "hf://org/a@v2"),
        "b": model("b", "hf://org/b"),
        "c": model("c", "pvc://models/c"),
        "d": model("d", "hf://org/d"),
        "e": model("e", "hf://not-an-org-slash-name"),  # malformed: nothing fetched
    }
    precise = PreciseRouting({"d": "/mnt/d-tokenizer"})
    precise.prepare(targets)
    assert loaded == [("org/a", "v2"), ("org/b", None), ("/mnt/d-tokenizer", None)]
    assert precise.unprepared(targets) == []  # tried once each; c stays unhashed
    assert precise.kv_hashes(targets["c"], BODY) == ()
    assert precise.kv_hashes(targets["e"], BODY) == ()


def test_a_tokenizer_that_failed_to_load_is_tried_again_after_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hub or volume briefly unreachable must not leave the model approximate until the
    gateway restarts: RETRY_S after a failure the load is tried again; a model with no
    tokenizer to load (pvc:// without a flag) is not."""
    from kubellm.gateway.routing.index import precise_routing as module

    attempts: list[str] = []

    def loader(path: str, revision: str | None = None) -> Any:
        attempts.append(path)
        if len(attempts) == 1:
            raise OSError("hub unreachable")
        return object()

    monkeypatch.setattr(module, "load_tokenizer", loader)
    now = [1000.0]
    precise = PreciseRouting(clock=lambda: now[0])
    routing = Routing(prefix_index="precise")
    targets = {
        "a": ModelTarget("a", "a", routing=routing, model_source="hf://org/a"),
        "c": ModelTarget("c", "c", routing=routing, model_source="pvc://models/c"),
    }
    precise.prepare(targets)
    assert attempts == ["org/a"] and precise.unprepared(targets) == []
    now[0] += module.RETRY_S - 1
    assert precise.unprepared(targets) == []
    now[0] += 1
    assert precise.unprepared(targets) == ["a"]
    precise.prepare(targets)
    assert attempts == ["org/a", "org/a"] and precise.unprepared(targets) == []
    now[0] += 10 * module.RETRY_S
    assert precise.unprepared(targets) == []  # loaded: never again


def test_tokenizer_flags_name_a_tokenizer_per_model():
    from kubellm.gateway.routing.index.precise_routing import tokenizer_pairs

    assert tokenizer_pairs(["m=/models/m", "n=org/name"]) == {"m": "/models/m", "n": "org/name"}
    with pytest.raises(ValueError, match="MODEL=PATH"):
        tokenizer_pairs(["no-equals"])


def test_the_gateway_cli_hands_its_tokenizers_to_the_routing_core():
    import argparse

    from kubellm.gateway import cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["--tokenizer", "tiny=/models/tiny"])
    assert cli.settings_from(args).scheduler.tokenizers == {"tiny": "/models/tiny"}


def test_the_load_bound_widens_for_the_replica_the_events_say_holds_the_prefix(
    tiny_model_dir: Path,
) -> None:
    """B holds the prefix by its events (A evicted it) and is past the plain bound: two
    candidates, B at 3 and A idle, so cap = ceil(1.25 x 4 / 2) = 3 and B is out, but a
    holder's cap is ceil(2.5 x 4 / 2) = 5. Precise mode keeps B (its events say it holds
    the prefix); approximate mode believes A holds it and sends it there."""
    from kubellm.gateway.routing.scorers.base import Candidate

    router, _, _ = setup(tiny_model_dir)
    assert router.precise is not None
    loads = [Candidate(url=A, load=0.0), Candidate(url=B, load=3.0)]

    def pick(prefix_index: str) -> str:
        request = routing_request("tiny", BODY, None)
        return router.order(target(prefix_index), request, loads)[0].url

    assert pick("precise") == B
    assert pick("approximate") == A
    router.precise.index.apply(B, 1, [0.0, [{"type": "AllBlocksCleared"}], 0])
    assert pick("precise") == A  # B no longer holds it: the plain bound again


HUB_STALLS = """
import asyncio, os, sys
from kubellm.api import Routing
from kubellm.gateway.discovery.base import Endpoint, ModelTarget
from kubellm.gateway.routing.index.kv_events import KVEventsSubscriber, KVIndex
from kubellm.gateway.routing.index.precise_routing import PreciseRouting

class Recorder(KVEventsSubscriber):
    synced = []
    def sync(self, addresses):
        self.synced.append(sorted(addresses))

async def main():
    index = KVIndex()
    precise = PreciseRouting(index=index, subscriber=Recorder(index), interval=0.05)
    target = ModelTarget("m", "m", endpoints=(Endpoint("http://127.0.0.1:9"),),
                         routing=Routing(prefix_index="precise"), model_source="hf://org/m")
    run = asyncio.create_task(precise.run(lambda: {"m": target}))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 90  # until the tokenizer's download reaches the hub
    while not os.path.exists(sys.argv[1]) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    before, deadline = len(Recorder.synced), loop.time() + 20
    while len(Recorder.synced) < before + 5 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    synced = len(Recorder.synced) - before  # while the hub holds the download
    still_loading = precise.unprepared({"m": target}) == ["m"]
    run.cancel()
    await asyncio.wait_for(asyncio.gather(run, return_exceptions=True), 5)
    print("synced", synced, "loading", still_loading, flush=True)

asyncio.run(main())
"""


def test_a_hub_that_never_answers_stalls_neither_the_events_nor_the_exit(tmp_path: Path) -> None:
    """An hf:// model's tokenizer comes from the hub; a hub that accepts and never answers
    (a loopback server here, through HF_ENDPOINT) held transformers' download for over 300 s
    in a trial despite HF_HUB_ETAG_TIMEOUT=1. The load runs in a daemon thread: the events
    keep being followed meanwhile (the model's prompts scored approximately), and the
    process still stops at once. Run in a child process: HF_ENDPOINT is read at import."""
    import os
    import socket
    import subprocess
    import sys
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    reached = tmp_path / "reached"

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(server.accept()[0])
                reached.touch()  # the child waits for this, then counts its syncs

    threading.Thread(target=accept, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env |= {
        "HF_ENDPOINT": f"http://127.0.0.1:{server.getsockname()[1]}",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", HUB_STALLS, str(reached)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.close()
        for connection in accepted:
            connection.close()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loading True" in done.stdout, (done.stdout, done.stderr[-2000:])
    synced = int(done.stdout.split()[1])
    assert synced >= 5
    assert accepted, "the tokenizer load never reached the (silent) hub"
