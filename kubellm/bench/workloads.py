"""Workloads: what each benchmark request asks for (pure, seeded, no I/O).

A workload is a list of `Conversation`s. Most are one turn; a multi-turn chat
session has several, each sending the whole history so far, so its context
grows turn by turn. The runner starts conversations on the arrival schedule
and plays a conversation's turns one after another.

Prompt lengths are in tokens only when a tokenizer is given (`--tokenizer DIR`):
then prompts are random token ids decoded to text and trimmed to length after
re-encoding (as `vllm bench serve --dataset-name random` does; when the
decode/encode round trip does not settle, a prompt can be a token or two off;
the server's usage chunk reports the real count). Without one,
prompts are made of common English words, one word per intended token; most
byte-pair tokenizers encode such words (with their leading space) as a single
token, so lengths are approximate, typically within 10-20 percent.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# Short, frequent words: one token each in the usual BPE vocabularies.
_WORD_TEXT = """
the of and to in is was for that on as with by at from his an were are which
this be has had one or have not but they their all new first its been also
after who more two time other into her can out up about there when over only
would year some most like three city may used school where world four many
state so made part such then well these will high any north even team game film
back life day work while both best
"""
WORDS = tuple(_WORD_TEXT.split())


class BenchError(ValueError):
    """Bad benchmark input; the message names the option or field."""


@dataclass(frozen=True)
class Turn:
    """One request: a completion prompt, or the new user message of a chat turn."""

    prompt: str
    max_tokens: int
    prompt_tokens: int  # intended (exact with a tokenizer, approximate with words)


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    chat: bool = False  # send as chat messages carrying the history
    at: float | None = None  # trace replay: arrival time in seconds from the start
    history: tuple[tuple[str, str], ...] = ()  # (role, content) sent before the first turn


@dataclass
class WorkloadSpec:
    kind: str = "random"
    num_requests: int = 100
    input_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (64, 64)
    num_prefixes: int = 4
    prefix_len: int = 256
    suffix_len: int = 32
    turns: int = 4
    trace: str | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer that prompt making needs."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def __len__(self) -> int: ...


TextMaker = Callable[[random.Random, int], str]


def word_text(rng: random.Random, n: int) -> str:
    """About `n` tokens of English words."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def tokenizer_text(tokenizer: Tokenizer) -> TextMaker:
    """Exactly `n` tokens (after re-encoding) of random ordinary ids from the vocabulary."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    vocab = [i for i in range(len(tokenizer)) if i not in special]

    def make(rng: random.Random, n: int) -> str:
        n = max(1, n)
        ids = [rng.choice(vocab) for _ in range(n)]
        text = tokenizer.decode(ids)
        for _ in range(16):  # decode/encode is not a bijection: adjust and retry
            got = tokenizer.encode(text, add_special_tokens=False)
            if len(got) == n:
                break
            got = got[:n] + [rng.choice(vocab) for _ in range(n - len(got))]
            text = tokenizer.decode(got)
        return text

    return make


def _length(rng: random.Random, span: tuple[int, int]) -> int:
    low, high = span
    return rng.randint(low, high)


def build(spec: WorkloadSpec, text: TextMaker = word_text) -> list[Conversation]:
    """The conversations of a workload, `spec.num_requests` requests in all."""
    if spec.num_requests < 1:
        raise BenchError("--num-requests: must be at least 1")
    for name, (low, high) in (("--input-len", spec.input_len), ("--output-len", spec.output_len)):
        if low < 1 or high < low:
            raise BenchError(f"{name}: expected N or LOW:HIGH with 1 <= LOW <= HIGH")
    rng = random.Random(spec.seed)
    if spec.kind == "random":
        return [
            Conversation((Turn(text(rng, n), _length(rng, spec.output_len), n),))
            for n in (_length(rng, spec.input_len) for _ in range(spec.num_requests))
        ]
    if spec.kind == "shared-prefix":
        if spec.num_prefixes < 1 or spec.prefix_len < 1 or spec.suffix_len < 1:
            raise BenchError("--num-prefixes, --prefix-len, --suffix-len: must be at least 1")
        prefixes = [text(rng, spec.prefix_len) for _ in range(spec.num_prefixes)]
        out = []
        for i in range(spec.num_requests):
            prompt = prefixes[i % spec.num_prefixes] + " " + text(rng, spec.suffix_len)
            n = spec.prefix_len + spec.suffix_len
            out.append(Conversation((Turn(prompt, _length(rng, spec.output_len), n),)))
        return out
    if spec.kind == "multi-turn":
        if spec.turns < 1:
            raise BenchError("--turns: must be at least 1")
        out, left = [], spec.num_requests
        while left > 0:
            k = min(spec.turns, left)
            turns = tuple(
                Turn(text(rng, n), _length(rng, spec.output_len), n)
                for n in (_length(rng, spec.input_len) for _ in range(k))
            )
            out.append(Conversation(turns, chat=True))
            left -= k
        return out
    if spec.kind == "trace":
        if not spec.trace:
            raise BenchError("--trace: required with --workload trace")
        return load_trace(Path(spec.trace), spec.num_requests, spec.output_len, text, rng)
    raise BenchError(f"--workload: unknown workload {spec.kind!r}")


def load_trace(
    path: Path,
    limit: int,
    output_len: tuple[int, int],
    text: TextMaker,
    rng: random.Random,
) -> list[Conversation]:
    """Replay a JSONL trace, one request per line.

    Fields: `prompt` (text) or `input_len` (tokens, a prompt is made up) or
    `messages` (chat, the last user message is sent with the rest as history);
    `output_len` or `max_tokens` (else drawn from --output-len); optional
    `timestamp` (seconds; replayed relative to the first line when no rate or
    concurrency is given).
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise BenchError(f"--trace: cannot read {path}: {error}") from None
    out: list[Conversation] = []
    first: float | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if len(out) >= limit:
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise BenchError(f"--trace: {path}:{number}: not JSON: {error}") from None
        if not isinstance(row, dict):
            raise BenchError(f"--trace: {path}:{number}: expected a JSON object")
        max_tokens = row.get("output_len", row.get("max_tokens"))
        if max_tokens is None:
            max_tokens = _length(rng, output_len)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise BenchError(f"--trace: {path}:{number}: output_len must be a positive integer")
        at = row.get("timestamp")
        if at is not None:
            if not isinstance(at, int | float):
                raise BenchError(f"--trace: {path}:{number}: timestamp must be a number")
            first = at if first is None else first
            at = float(at - first)
        if isinstance(row.get("prompt"), str) and row["prompt"]:
            prompt, n = row["prompt"], len(row["prompt"].split())
            out.append(Conversation((Turn(prompt, max_tokens, n),), at=at))
        elif isinstance(row.get("input_len"), int) and row["input_len"] > 0:
            n = row["input_len"]
            out.append(Conversation((Turn(text(rng, n), max_tokens, n),), at=at))
        elif isinstance(row.get("messages"), list) and row["messages"]:
            messages = row["messages"]
            last = messages[-1].get("content") if isinstance(messages[-1], dict) else None
            if not isinstance(last, str):
                raise BenchError(f"--trace: {path}:{number}: messages[-1].content must be text")
            history = tuple(
                (str(m.get("role", "user")), str(m.get("content", "")))
                for m in messages[:-1]
                if isinstance(m, dict)
            )
            turn = Turn(last, max_tokens, len(last.split()))
            out.append(Conversation((turn,), chat=True, at=at, history=history))
        else:
            raise BenchError(
                f"--trace: {path}:{number}: needs one of prompt, input_len or messages"
            )
    if not out:
        raise BenchError(f"--trace: {path} holds no requests")
    return out


def count_requests(conversations: Sequence[Conversation]) -> int:
    return sum(len(c.turns) for c in conversations)
