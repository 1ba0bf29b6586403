"""The tiny LoRA adapter: PEFT's files, vLLM's names, and the same bytes on every build."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kubellm.engine import tiny_lora


def _digest(directory: Path) -> str:
    return hashlib.sha256((directory / "adapter_model.safetensors").read_bytes()).hexdigest()


def test_the_adapter_is_deterministic_and_in_peft_format(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    one = tiny_lora.build(tmp_path / "one", tiny_model_dir, steps=3)
    two = tiny_lora.build(tmp_path / "two", tiny_model_dir, steps=3)
    assert tiny_lora.is_built(one) and _digest(one) == _digest(two)
    config = json.loads((one / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == (
        "LORA",
        tiny_lora.RANK,
        list(tiny_lora.TARGET_MODULES),
    )
    weights = load_file(str(one / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in weights
    trained = weights["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"]
    assert float(trained.abs().sum()) > 0  # B starts at zero; training moved it
