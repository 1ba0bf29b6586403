"""The gateway's block hashes equal vLLM's: against vLLM's own hashing functions, and
against the BlockStored events a real vLLM CPU engine publishes for the same prompts."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubellm.gateway.routing.kv_hashes import BlockHasher, external, hash_function

from tests.fixtures.engines import free_port, running_vllm, tiny_spec, wait_until

needs_vllm_module = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="compares with vLLM's own functions"
)


@pytest.fixture(scope="module")
def vllm_hashing(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """vLLM's kv_cache_utils, importable beside the launcher's torchcodec stand-in."""
    from kubellm.engine import launcher

    if launcher.torchcodec_broken():
        sys.path.insert(0, launcher.write_torchcodec_shim(tmp_path_factory.mktemp("shim")))
    from vllm.v1.core import kv_cache_utils

    return kv_cache_utils


@needs_vllm_module
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_block_hashes_equal_vllms_hash_block_tokens(vllm_hashing: Any, algo: str) -> None:
    from vllm.utils.hashing import get_hash_fn_by_name

    fn = get_hash_fn_by_name(algo)
    vllm_hashing.init_none_hash(fn)
    tokens = list(range(1000, 1000 + 16 * 5 + 7))  # five full blocks and a partial one
    lora = ("adapter-a", "/models/adapters/a")
    for extra, salt in [(None, None), ((("lora", *lora),), None), (None, "tenant-7")]:
        expected, parent = [], None
        for i in range(5):
            keys = extra
            if i == 0 and salt:
                keys = (*(extra or ()), ("cache_salt", salt))
            parent = vllm_hashing.hash_block_tokens(fn, parent, tokens[i * 16 : i * 16 + 16], keys)
            expected.append(vllm_hashing.maybe_convert_block_hash(parent))
        got = BlockHasher(16, algo).block_hashes(
            tokens, lora=lora if extra else None, cache_salt=salt
        )
        assert list(got) == expected


def test_partial_blocks_are_not_hashed_and_blocks_chain() -> None:
    hasher = BlockHasher(4)
    assert hasher.block_hashes([1, 2, 3]) == ()
    one = hasher.block_hashes([1, 2, 3, 4, 5])
    two = hasher.block_hashes([1, 2, 3, 4, 5, 6, 7, 8])
    assert len(one) == 1 and two[0] == one[0]
    assert BlockHasher(4).block_hashes([9, 2, 3, 4, 5, 6, 7, 8])[1] != two[1]  # chained
    assert all(0 <= h < 2**64 for h in two)
    assert external(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")


def test_unreproducible_algorithms_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="xxhash"):
        hash_function("xxhash")
    with pytest.raises(ValueError, match="block size 0"):
        BlockHasher(0)


# ------------------------------------------------------------------ real vLLM on CPU

# A KV pool of 40 blocks of 32 tokens (1,280 tokens; max model length 1,024): two long
# prompts do not fit together, so the second evicts the first (tests/gateway/test_precise.py).
EVENTS_POOL_BLOCKS = 40
EVENTS_BLOCK_SIZE = 32


def events_spec(model_dir: Path, kv_events_port: int) -> dict[str, Any]:
    spec = tiny_spec(model_dir)
    spec["engine"]["maxNumSeqs"] = 4
    spec["engine"]["extraArgs"] = ["--num-gpu-blocks-override", str(EVENTS_POOL_BLOCKS)]
    spec["routing"] = {"prefixIndex": "precise", "kvEventsPort": kv_events_port}
    return spec


def _port_pair() -> int:
    """A free port whose successor is free too (the publisher and its replay socket)."""
    import socket

    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of ports")


@pytest.fixture(scope="session")
def vllm_events_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, int]]:
    """A real vLLM started through the launcher with spec.routing.prefixIndex precise (so
    the launcher turns its KV events on) and a small pool; yields (URL, events port)."""
    port = _port_pair()
    with running_vllm(events_spec(tiny_model_dir, port), tmp_path_factory.mktemp("vllm")) as url:
        yield url, port


class _Events:
    """A SUB socket on the engine's publisher collecting BlockStored hashes."""

    def __init__(self, port: int) -> None:
        import zmq

        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.stored: list[int] = []
        self.removed: list[int] = []

    def drain(self) -> None:
        import msgspec

        while self.socket.poll(0):
            _, _, payload = self.socket.recv_multipart()
            for event in msgspec.msgpack.decode(payload)[1]:
                if event["type"] == "BlockStored":
                    self.stored += event["block_hashes"]
                elif event["type"] == "BlockRemoved":
                    self.removed += event["block_hashes"]

    def close(self) -> None:
        self.socket.close(linger=0)


def _connected(url: str, events: _Events) -> None:
    """Send throwaway requests until the SUB socket sees an event (ZMQ's slow joiner)."""
    marker = 0

    def seen() -> bool:
        nonlocal marker
        marker += 1
        prompt = f"warm {marker} " + "pebbles " * 40
        httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt,
                   "max_tokens": 1}, timeout=60)  # fmt: skip
        events.drain()
        return bool(events.stored)

    wait_until(seen, 30, "the first KV event", interval=0.2)


WORDS = "the quick brown fox jumps over the lazy dog while seven rivers run to the sea "


@pytest.mark.vllm
def test_gateway_hashes_equal_the_block_stored_events_of_real_vllm(
    vllm_events_server: tuple[str, int], tiny_model_dir: Path
) -> None:
    from kubellm.gateway.routing.kv_hashes import PromptTokenizer

    url, port = vllm_events_server
    tokenizer = PromptTokenizer(tiny_model_dir)
    hasher = BlockHasher(EVENTS_BLOCK_SIZE)
    events = _Events(port)
    try:
        _connected(url, events)
        bodies = [
            {"model": "tiny", "prompt": "alpha " + WORDS * 8, "max_tokens": 1},
            {"model": "tiny", "prompt": [["tokens"]], "max_tokens": 1},  # replaced below
            {"model": "tiny", "max_tokens": 1, "messages": [
                {"role": "system", "content": "beta " + WORDS * 6},
                {"role": "user", "content": "and what then?"}]},
            {"model": "tiny", "max_tokens": 1, "messages": [
                {"role": "system", "content": "gamma " + WORDS * 3},
                {"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": WORDS * 2}]},
        ]  # fmt: skip
        bodies[1]["prompt"] = list(range(5, 5 + EVENTS_BLOCK_SIZE * 3 + 5))
        for body in bodies:
            route = "chat/completions" if "messages" in body else "completions"
            events.drain()
            events.stored.clear()
            answer = httpx.post(f"{url}/v1/{route}", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            token_ids = tokenizer.token_ids(body)
            assert token_ids is not None
            assert len(token_ids) == answer.json()["usage"]["prompt_tokens"]
            expected = list(hasher.block_hashes(token_ids))
            assert len(expected) >= 3
            deadline = time.monotonic() + 10
            while len(events.stored) < len(expected) and time.monotonic() < deadline:
                events.socket.poll(200)
                events.drain()
            # vLLM stores the prompt's full blocks (and, once decoding fills one, more).
            assert events.stored[: len(expected)] == expected, json.dumps(body)[:120]
    finally:
        events.close()
