"""A tiny LoRA adapter for the tiny checkpoint, trained locally and deterministically.

It is written in PEFT's on-disk format (`adapter_config.json`, `adapter_model.safetensors`
with `base_model.model.<module>.lora_A.weight` / `lora_B.weight`), which is what vLLM's
LoRA loader reads, without depending on the `peft` package: rank-`RANK` matrices on the
attention's q_proj and v_proj, B starting at zero as LoRA does, trained for a few steps
(seeded, one thread, fixed batches) to make the model repeat `TARGET`. The adapter then
answers differently from the base model on the same prompt, which is what the real-engine
tests check.
"""

from __future__ import annotations

import json
from pathlib import Path

RANK = 8
ALPHA = 16
TARGET_MODULES = ("q_proj", "v_proj")
TARGET = "the adapter says kubellm serves many fine tunes on one base model. "
STEPS = 60
LR = 1e-2
SEED = 7
FILES = ("adapter_config.json", "adapter_model.safetensors")


def build(directory: str | Path, model_dir: str | Path, steps: int = STEPS) -> Path:
    """Train the adapter on the checkpoint in `model_dir` and write it into `directory`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(SEED)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
        model.requires_grad_(False)
        scale = ALPHA / RANK
        weights: dict[str, torch.Tensor] = {}
        params = []
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] not in TARGET_MODULES:
                continue
            a = torch.nn.Parameter(torch.randn(RANK, module.in_features) * 0.01)
            b = torch.nn.Parameter(torch.zeros(module.out_features, RANK))
            params += [a, b]
            weights[name] = (a, b)  # type: ignore[assignment]

            def forward(x, base=module.forward, a=a, b=b):  # type: ignore[no-untyped-def]
                return base(x) + (x @ a.T @ b.T) * scale

            module.forward = forward  # type: ignore[method-assign]
        ids = tokenizer.encode(TARGET * 8)
        data = torch.tensor([ids[:64]] * 4)
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        model.train()
        for _ in range(steps):
            loss = model(input_ids=data, labels=data).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        tensors = {}
        for name, (a, b) in weights.items():  # type: ignore[misc]
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().contiguous()
        save_file(tensors, str(out / "adapter_model.safetensors"))
    finally:
        torch.set_num_threads(threads)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": str(model_dir),
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def is_built(directory: str | Path) -> bool:
    return all((Path(directory) / f).exists() for f in FILES)
