"""The simulator simulates the spec it is given: engine fields onto the profile."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from kubellm.engine import cli, sim_profiles

from kubellm import api
from tests.fixtures.schema import leaf_fields

TINY = sim_profiles.get("tiny-cpu")
H100 = sim_profiles.get("llama-3.1-8b-h100")


def _engine(**fields: Any) -> api.EngineSpec:
    return api.EngineSpec.model_validate(fields)


def test_every_engine_field_is_either_simulated_or_ignored_with_a_reason() -> None:
    listed = [*sim_profiles.SPEC_FIELDS, *sim_profiles.IGNORED_FIELDS]
    assert len(listed) == len(set(listed))
    for field in leaf_fields(api.EngineSpec):  # the field itself, or its parent, has a row
        parts = field.split(".")
        rows = [
            ".".join(parts[:n]) for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in listed
        ]
        assert len(rows) == 1, f"spec.engine.{field} needs one row in sim_profiles"
    fields = leaf_fields(api.EngineSpec)
    for row in listed:  # no row for a field that does not exist
        assert any(f == row or f.startswith(f"{row}.") for f in fields), row
    assert all(sim_profiles.IGNORED_FIELDS.values())


# (engine fields, profile attribute, expected value)
TABLE = [
    ({"maxNumSeqs": 8}, "max_num_seqs", 8),
    ({}, "max_num_seqs", TINY.max_num_seqs),
    ({"maxModelLen": 512}, "max_model_len", 512),
    ({}, "max_model_len", TINY.max_model_len),
    ({"prefixCaching": False}, "prefix_caching", False),
    ({}, "prefix_caching", True),
    ({"chunkedPrefill": {"maxNumBatchedTokens": 256}}, "max_num_batched_tokens", 256),
    ({}, "max_num_batched_tokens", 2048),  # the API's default, what vLLM is given
    ({"chunkedPrefill": {"enabled": False, "maxNumBatchedTokens": 4096}}, "chunked_prefill",
     False),
    ({"blockSize": 64}, "block_size", 64),
    ({}, "block_size", sim_profiles.VLLM_DEFAULT_BLOCK_SIZE_CPU),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "attribute", "expected"), TABLE)
def test_engine_fields_map_onto_the_profile(
    fields: dict[str, Any], attribute: str, expected: object
) -> None:
    profile = sim_profiles.from_spec(TINY, _engine(**fields), cpu=True)
    assert getattr(profile, attribute) == expected


def test_a_block_size_change_keeps_the_pool_bytes_and_gpus_default_to_vllms_16() -> None:
    profile = sim_profiles.from_spec(TINY, _engine(blockSize=64), cpu=True)
    assert profile.num_blocks * 64 == TINY.num_blocks * TINY.block_size
    on_gpu = sim_profiles.from_spec(H100, _engine(), cpu=False)
    assert on_gpu.block_size == sim_profiles.VLLM_DEFAULT_BLOCK_SIZE_GPU == H100.block_size
    assert on_gpu.num_blocks == H100.num_blocks


def test_ignored_fields_change_nothing() -> None:
    plain = sim_profiles.from_spec(H100, _engine(), cpu=False)
    busy = _engine(
        dtype="float16", quantization="awq", kvCacheDtype="fp8", gpuMemoryUtilization=0.5,
        tensorParallelSize=2, speculative={"method": "ngram"}, image="x", port=9000,
        extraArgs=["--enforce-eager"],
    )  # fmt: skip
    assert sim_profiles.from_spec(H100, busy, cpu=False) == plain


def test_a_budget_below_the_context_without_chunked_prefill_is_refused_naming_the_field() -> None:
    engine = _engine(chunkedPrefill={"enabled": False, "maxNumBatchedTokens": 512})
    with pytest.raises(ValueError, match=r"spec.engine.chunkedPrefill.maxNumBatchedTokens 512"):
        sim_profiles.from_spec(TINY, engine, cpu=True)


def test_the_engine_command_reads_the_spec_file(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "model: {source: 'hf://org/m', servedName: chat}\n"
        "engine: {maxNumSeqs: 8, blockSize: 32}\nresources: {gpu: {count: 0}}\n"
    )
    profile, served = cli.sim_profile(None, str(spec))
    assert (profile.name, profile.max_num_seqs, profile.block_size, served) == (
        "tiny-cpu", 8, 32, "chat",
    )  # fmt: skip
    assert cli.sim_profile("llama-3.1-8b-h100", str(spec))[0].name == "llama-3.1-8b-h100"
    assert cli.sim_profile(None, None) == (H100, None)
    spec.write_text("engine: {maxNumSeqs: 0}\n")
    with pytest.raises(ValueError, match=r"spec\.model"):
        cli.sim_profile(None, str(spec))


def _help(configure: Any) -> str:
    parser = argparse.ArgumentParser(prog="kubellm")
    configure(parser)
    return " ".join(parser.format_help().split())


def test_help_says_which_engine_fields_the_simulator_ignores() -> None:
    from kubellm.fleet import up

    for text in (_help(cli.configure), _help(up.configure)):
        for name in (*sim_profiles.SPEC_FIELDS, *sim_profiles.IGNORED_FIELDS):
            assert name in text, name
