"""Static discovery: a YAML file listing, per served model, its engine URLs and settings.

    models:
      - name: tiny                      # the model name clients send
        deployment: tiny                # optional, metric label (default: name)
        namespace: default              # optional, metric label
        endpoints:
          - http://127.0.0.1:8001       # an engine's base URL
          - {url: http://127.0.0.1:8002, draining: true}
          - {url: http://127.0.0.1:8003, kvEventsPort: 7003}   # prefixIndex precise: its
                                        # own events port (default routing.kvEventsPort)
        routing: {policy: prefix-aware, loadBound: 1.25}   # kubellm.api.Routing
        slo: {ttftSeconds: 2, itlSeconds: 0.1}               # kubellm.api.SLO
        fallback:                                            # kubellm.api.Fallback, except
          url: https://api.openai.com/v1                     # the key: instead of
          model: gpt-4o-mini                                 # apiKeySecretRef give
          apiKeyEnv: OPENAI_API_KEY                          # an env var name, or
          # apiKey: sk-...                                   # the key inline
        adapters:                       # LoRA adapters: name -> the path (or Hugging
          sql: /models/adapters/sql     # Face id) a replica loads it from
        decodeTokensPerSecondBound: 143 # optional: as status.capacity's, the prior of
                                        # the slo-aware latency model (default: H100 8B)
        # a canary rollout outside Kubernetes: endpoints carry their revision
        # ({url: ..., revision: r2}) and `rollout` is status.rollout's split, e.g. the
        # shadow step: {canaryRevision: r2, phase: Progressing, canaryWeight: 0,
        #               shadow: {share: 0.1, maxConcurrency: 4, firstTokens: 16}}

A model with no endpoints but a fallback is served by the fallback alone. The
file is re-read when it changes; an endpoint removed from it drains: it gets
no new requests, while requests already sent to it finish on their own
connections.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from kubellm.gateway.discovery.base import (
    AdapterRef,
    Endpoint,
    FallbackTarget,
    ModelTarget,
    PrefillSplit,
    canary_split,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kubellm.api import SLO, Fallback, RolloutStatus, Routing
from kubellm.capacity import KV_LINK_GBPS
from kubellm.contracts import fallback_target
from kubellm.manifests import ManifestError, explain, read_documents

log = logging.getLogger("kubellm.gateway")


class StaticConfigError(ValueError):
    """The static file is invalid; the message names the field."""


class StaticFallback(Fallback):
    """`spec.fallback` with the key given inline or by env var name instead of a Secret."""

    rules = tuple(r for r in Fallback.rules if "apiKeySecretRef" not in r.expression)

    api_key_env: str | None = Field(default=None, min_length=1)
    api_key: str | None = Field(default=None, min_length=1, repr=False)


class StaticEndpoint(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    url: str
    draining: bool = False
    kv_events_port: int | None = Field(default=None, alias="kvEventsPort", ge=1, le=65534)
    revision: str | None = Field(default=None, min_length=1, max_length=63)
    # contracts.ROLE_LABEL's values (spec.prefill); absent: it serves both phases
    role: Literal["prefill", "decode"] | None = None

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        if "@" in url.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError("must not carry credentials (user:password@): engines take none")
        return url.rstrip("/")


class StaticPrefill(BaseModel):
    """A model with a prefill role (the endpoints with `role: prefill`): as spec.prefill."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    split: Literal["Conditional", "Always"] = "Conditional"
    kv_bytes_per_token: int = Field(
        default=PrefillSplit.kv_bytes_per_token, alias="kvBytesPerToken", ge=1, le=1 << 30
    )
    link_bandwidth_gbps: float = Field(
        default=KV_LINK_GBPS["rdma"], alias="linkBandwidthGBps", gt=0, le=1e5,
        allow_inf_nan=False,
    )  # fmt: skip


class StaticModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    deployment: str | None = None
    namespace: str = "default"
    # The InferencePool of its engines, for `kubellm epp --pool-name` (default: the
    # operator's name, "<deployment>-engine")
    pool: str | None = Field(default=None, min_length=1)
    endpoints: list[StaticEndpoint | str] = Field(default_factory=list)
    routing: Routing = Field(default_factory=Routing)
    fallback: StaticFallback | None = None
    slo: SLO = Field(default_factory=SLO)
    prefill: StaticPrefill | None = None
    # LoRA adapters: name -> the path (or Hugging Face id) a replica loads it from
    adapters: dict[str, str] = Field(default_factory=dict)
    # As status.rollout: the canary's revision, phase, weight and shadow step
    rollout: RolloutStatus | None = None
    # As status.capacity.decodeTokensPerSecondBound: the slo-aware latency model's prior
    decode_tokens_per_second_bound: float | None = Field(
        # routing/latency/model.py DECODE_BOUND_RANGE (discovery does not import routing)
        default=None,
        alias="decodeTokensPerSecondBound",
        ge=1,
        le=1e6,
        allow_inf_nan=False,
    )

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, items: list[StaticEndpoint | str]) -> list[StaticEndpoint | str]:
        return [StaticEndpoint(url=i) if isinstance(i, str) else i for i in items]


class StaticFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    models: list[StaticModel]


def _fallback(spec: StaticFallback | None, env: Mapping[str, str]) -> FallbackTarget | None:
    if spec is None or spec.url is None:
        return None
    key = spec.api_key
    if spec.api_key_env:
        if spec.api_key_env not in env:
            raise StaticConfigError(
                f"fallback.apiKeyEnv: environment variable {spec.api_key_env} is not set"
            )
        key = env[spec.api_key_env]
    return fallback_target(spec, key)


def parse(document: Any, env: Mapping[str, str] | None = None) -> dict[str, ModelTarget]:
    """The models of a static file's parsed YAML; StaticConfigError names a bad field."""
    env = os.environ if env is None else env
    try:
        parsed = StaticFile.model_validate(document)
    except ValidationError as error:
        raise StaticConfigError(f"invalid gateway static file\n{explain(error)}") from None
    models: dict[str, ModelTarget] = {}
    for index, m in enumerate(parsed.models):
        if m.name in models:
            raise StaticConfigError(f"models[{index}].name: duplicate model {m.name!r}")
        models[m.name] = ModelTarget(
            served_name=m.name,
            deployment=m.deployment or m.name,
            namespace=m.namespace,
            endpoints=tuple(
                Endpoint(e.url, e.draining, e.kv_events_port, e.revision, role=e.role)
                for e in m.endpoints
                if isinstance(e, StaticEndpoint)
            ),
            routing=m.routing,
            fallback=_fallback(m.fallback, env),
            slo=m.slo,
            adapters=tuple(AdapterRef(n, p) for n, p in m.adapters.items()),
            pool=m.pool,
            canary=None
            if m.rollout is None
            else canary_split(m.rollout.model_dump(by_alias=True, exclude_none=True, mode="json")),
            decode_tokens_per_second_bound=m.decode_tokens_per_second_bound,
            prefill=None
            if m.prefill is None
            else PrefillSplit(
                m.prefill.split, m.prefill.kv_bytes_per_token, m.prefill.link_bandwidth_gbps * 1e9
            ),
        )
    return models


def load(path: str | Path, env: Mapping[str, str] | None = None) -> dict[str, ModelTarget]:
    """The models of a static file. Its YAML is read as manifests are (duplicate keys,
    aliasing and depth bounded), and errors name the line and column but never quote
    it: the file may hold an inline `apiKey`."""
    path = Path(path)
    try:
        documents = read_documents(path)
    except ManifestError as error:
        raise StaticConfigError(str(error)) from None
    if len(documents) != 1:
        raise StaticConfigError(f"{path}: expected one YAML document, found {len(documents)}")
    try:
        return parse(documents[0], env)
    except StaticConfigError as error:
        raise StaticConfigError(f"{path}: {error}") from None


class StaticDiscovery:
    """Serves a static file; re-reads it when its modification time changes.

    A file that breaks on reload is logged (the error names the line) and counted
    through `on_reload_error`; the last good snapshot stays in service."""

    def __init__(
        self,
        path: str | Path,
        poll_seconds: float = 1.0,
        on_reload_error: Callable[[], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.poll_seconds = poll_seconds
        self.on_reload_error = on_reload_error
        self._mtime = self.path.stat().st_mtime_ns if self.path.exists() else None
        self._models = load(self.path)

    def snapshot(self) -> Mapping[str, ModelTarget]:
        return self._models

    def reload(self) -> bool:
        """Re-read the file if it changed; a broken file keeps the last good snapshot."""
        mtime = self.path.stat().st_mtime_ns
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        try:
            new = load(self.path)
        except StaticConfigError as error:
            log.error("static configuration not reloaded, keeping the last good one: %s", error)
            if self.on_reload_error is not None:
                self.on_reload_error()
            return False
        self._models = new
        log.info("static configuration reloaded: %d models", len(new))
        return True

    async def run(self, on_change: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                # in a worker thread: a file near the 3 MiB bound takes seconds to parse,
                # and the event loop serves every tenant meanwhile
                changed = await asyncio.to_thread(self.reload)
            except OSError as error:
                log.error("static configuration not readable: %s", error.strerror or error)
                if self.on_reload_error is not None:
                    self.on_reload_error()
                continue
            if changed:
                on_change()
