"""The values scorers see: the request's routing features and the candidate endpoints."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol


class Candidate(NamedTuple):
    """An endpoint that passed the health filters, with the load the gateway sees on it.

    `waiting`, `kv_usage` and `running` are None when the engine's metrics are stale or
    missing. (A tuple, not a frozen dataclass: every request builds one per replica, and a
    frozen dataclass costs four times as much to build.)
    """

    url: str
    load: float = 0.0
    in_flight: int = 0
    waiting: float | None = None
    kv_usage: float | None = None
    running: float | None = None


class RoutingRequest(NamedTuple):
    """What routing knows of a request: its prompt's chunk-hash chain and session key.

    (A tuple, not a frozen dataclass, like `Candidate`: every request builds one, and a
    frozen dataclass costs four times as much to build. A changed copy is `_replace(...)`.)
    """

    model: str
    chunk_hashes: tuple[int, ...] = ()
    affinity_key: int | None = None
    session: str | None = None
    adapter: str | None = None  # the LoRA adapter it names, or None for the base model
    # Precise mode (scorers/precise.py): the prompt's vLLM block hashes, filled by the
    # router from `body` (the parsed request, kept by reference) when the model asks.
    kv_hashes: tuple[int, ...] = ()
    body: Mapping[str, Any] | None = None
    # the prompt's length (latency prediction: routing/latency/predictions.py)
    prompt_chars: int = 0


class Scorer(Protocol):
    name: str

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> list[float]: ...
