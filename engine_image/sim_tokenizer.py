"""Deterministic tokenization for the simulator.

By default the UTF-8 text is cut into 4-byte pieces (4 characters of English,
about what BPE tokenizers average), each read as a number and folded into the
vocabulary, so equal prefixes give equal token ids and prefix caching behaves
as with a real tokenizer; it is cheap (C-level unpacking) and stable across
processes. Given a Hugging
Face tokenizer folder (`--tokenizer DIR`), the simulator tokenizes exactly as
vLLM would for that checkpoint, which the fidelity check relies on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from kubellm.sim_text import CHARS_PER_TOKEN, ApproxTokens

__all__ = ["CHARS_PER_TOKEN", "ApproxTokenizer", "HFTokenizer", "Tokenizer", "load"]
# Words the simulator "generates"; plain, so streamed output is readable.
WORDS = ("sim", "token", "cache", "block", "batch", "step", "queue", "reply", "model", "text")


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode_one(self, token: int) -> str: ...


class ApproxTokenizer(ApproxTokens):
    """4 bytes of UTF-8 per token (kubellm.sim_text, shared with the gateway's precise
    routing over simulated replicas); output tokens read as plain words."""

    def decode_one(self, token: int) -> str:
        return WORDS[token % len(WORDS)] + " "


class HFTokenizer:
    """A `tokenizer.json` from a checkpoint folder, via the `tokenizers` library."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"--tokenizer {directory}: no tokenizer.json there")
        self._tokenizer = _Tokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode_one(self, token: int) -> str:
        return self._tokenizer.decode([token])


def load(directory: str | Path | None) -> Tokenizer:
    return HFTokenizer(directory) if directory else ApproxTokenizer()
