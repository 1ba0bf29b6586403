"""The gateway's block hashes equal vLLM's own hashing functions' (sha256 and sha256_cbor,
with LoRA and cache-salt keys)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
from kubellm.gateway.routing.index.kv_hashes import BlockHasher, external, hash_function

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


# The same against a real vLLM CPU engine's BlockStored events:
# tests/gateway/routing/index/test_precise_e2e.py


@needs_vllm_module
def test_an_adapter_requests_hashes_are_vllms_with_its_extra_keys(vllm_hashing: Any) -> None:
    """The gateway's path for a request naming an adapter, with a cache salt: the prompt's
    hashes equal vLLM's, extra keys from vLLM's own generate_block_hash_extra_keys on a
    request with that LoRA (name, path) and salt; the base model's differ."""
    from types import SimpleNamespace

    from kubellm.gateway.discovery.base import AdapterRef, Endpoint, ModelTarget
    from kubellm.gateway.routing.index.kv_hashes import SimPromptTokenizer
    from kubellm.gateway.routing.index.precise_routing import PreciseRouting
    from vllm.utils.hashing import get_hash_fn_by_name

    from kubellm.api import Routing

    url = "http://10.0.0.1:8000"
    target = ModelTarget(
        served_name="base", deployment="base", endpoints=(Endpoint(url),),
        routing=Routing(prefix_index="precise"),
        adapters=(AdapterRef("sql", "/models/adapters/sql"),),
    )  # fmt: skip
    precise = PreciseRouting({"base": "simulator"})
    precise.prepare({"base": target})
    precise.index.apply(url, 0, [0.0, [{"type": "BlockStored", "block_hashes": [1],
                                         "block_size": 16}], 0])  # fmt: skip
    body = {"model": "sql", "prompt": "select the rows " * 20, "cache_salt": "tenant-7"}
    got = precise.kv_hashes(target, body)
    tokens = SimPromptTokenizer().token_ids(body) or []
    fn = get_hash_fn_by_name("sha256")
    vllm_hashing.init_none_hash(fn)
    request = SimpleNamespace(
        mm_features=[], cache_salt="tenant-7", prompt_embeds=None,
        lora_request=SimpleNamespace(lora_name="sql", lora_path="/models/adapters/sql"),
    )  # fmt: skip
    expected, parent = [], None
    for i in range(len(tokens) // 16):
        keys, _ = vllm_hashing.generate_block_hash_extra_keys(request, i * 16, i * 16 + 16, 0)
        parent = vllm_hashing.hash_block_tokens(fn, parent, tokens[i * 16 : i * 16 + 16], keys)
        expected.append(vllm_hashing.maybe_convert_block_hash(parent))
    assert list(got) == expected and len(expected) > 2
    base = precise.kv_hashes(target, {**body, "model": "base"})
    assert not set(base) & set(got)  # the base model's blocks are other blocks
    unsalted = precise.kv_hashes(target, {"model": "sql", "prompt": body["prompt"]})
    assert unsalted[0] != got[0]
