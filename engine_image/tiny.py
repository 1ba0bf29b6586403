"""A tiny Llama-architecture checkpoint, built offline and deterministically.

Tests and the local quick start need a model that vLLM's CPU backend loads in
seconds and that needs no model hub. This builds one from a fixed seed: two
layers, head dimension 64 (CPU attention needs at least 64), a byte-level BPE
tokenizer trained on `kubellm.engine.corpus`, and a chat template. The weights
are then trained for a few seconds on that same corpus, so the model answers
with the corpus's words (memorised, not understood); it exists to exercise the
serving path (batching, KV cache, prefix caching, streaming, metrics).

Building twice gives byte-identical files, so the result can be cached by a
content hash (`fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

from kubellm.engine.corpus import CORPUS

VOCAB_SIZE = 512
HIDDEN_SIZE = 128
NUM_HEADS = 2  # head_dim = 128 / 2 = 64
NUM_KV_HEADS = 1
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 2048
SEED = 0
# A few seconds of training on the corpus, so the quick start speaks in its words.
TRAIN_STEPS = 400
TRAIN_BATCH = 8
TRAIN_SEQ_LEN = 64
TRAIN_LR = 5e-3
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")

# A minimal chat template: role tags, then the assistant's turn is opened.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

# Files without which vLLM cannot load the checkpoint.
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _tokenizer():  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def train(model, tokenizer, steps: int, progress=None) -> float:  # type: ignore[no-untyped-def]
    """Fit the model to the corpus for `steps` steps (seconds on one core); final loss.

    Deterministic: fixed seed, one thread, fixed batch order. The point is a
    quick start that answers in the corpus's words rather than noise.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids = []
        for paragraph in CORPUS.split("\n\n"):
            ids += [*tokenizer.encode(paragraph.replace("\n", " ")), tokenizer.eos_token_id]
        data = torch.tensor(ids)
        generator = torch.Generator().manual_seed(SEED)
        optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, weight_decay=0.0)
        model.train()
        loss = torch.tensor(0.0)
        for step in range(steps):
            if progress is not None and step % 20 == 0:
                progress(f"training step {step}/{steps}")
            starts = torch.randint(
                0, len(data) - TRAIN_SEQ_LEN, (TRAIN_BATCH,), generator=generator
            )
            batch = torch.stack([data[i : i + TRAIN_SEQ_LEN] for i in starts.tolist()])
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return float(loss.detach())
    finally:
        torch.set_num_threads(threads)


def build(
    directory: str | Path,
    train_steps: int = TRAIN_STEPS,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write the tiny checkpoint (config, safetensors weights, tokenizer) into `directory`.

    The weights are trained for `train_steps` steps on the corpus (0: random).
    `progress`, when given, is told what is happening (a short phrase) as it goes.
    """
    say = progress or (lambda _: None)
    say("loading torch and transformers")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    say("training the tokenizer")
    tokenizer = _tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HIDDEN_SIZE // NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    if train_steps:
        train(model, tokenizer, train_steps, progress)
    say("writing the checkpoint")
    model.eval().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)  # vLLM needs none
    return out


def fingerprint(directory: str | Path) -> str:
    """SHA-256 over the checkpoint's files (not dotfiles): equal hashes, equal checkpoints."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).iterdir() if p.is_file() and p.name[0] != "."):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def is_built(directory: str | Path) -> bool:
    """True when every checkpoint file is present (a cheap check before rebuilding)."""
    return all((Path(directory) / name).exists() for name in CHECKPOINT_FILES)


def describe(directory: str | Path) -> dict[str, object]:
    """The architecture numbers of a built checkpoint (for logs and the capacity planner)."""
    config = json.loads((Path(directory) / "config.json").read_text())
    keys = ("num_hidden_layers", "num_key_value_heads", "head_dim", "vocab_size")
    return {key: config.get(key) for key in keys}


if __name__ == "__main__":  # `python -m kubellm.engine.tiny DIR`: what `kubellm up` runs
    if len(sys.argv) != 2:
        sys.exit("usage: python -m kubellm.engine.tiny DIR")
    build(sys.argv[1], progress=lambda what: print(f"tiny: {what}", flush=True))
    print(f"tiny: built {sys.argv[1]}", flush=True)
