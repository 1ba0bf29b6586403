"""The local runtime: LLMDeployments realised as local processes instead of Kubernetes objects.

In a cluster the operator turns a deployment into a Deployment of engine pods
(each running `kubellm engine --spec SPEC_PATH`), the gateway discovers the
ready pods through EndpointSlices, and the autoscaler writes `/scale`. Here the
same three contracts are met by one object:

- the engine spec (`kubellm.contracts.engine_spec_json`: what the operator
  mounts in an engine pod) is written to a file and run as `kubellm engine --spec FILE`
  processes by the `Supervisor` (`--engine sim` runs the simulator on the same
  file instead);
- `gateway_targets()` feeds the gateway's `Discovery` interface (ready,
  non-draining replicas and each deployment's routing, fallback and SLO);
- `LocalBackend` implements the autoscaler's `Backend` interface: it lists
  deployments, reports replica endpoints and takes replica writes.

No component knows it runs locally.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubellm import api
from kubellm.autoscaler.backend import AdapterTarget, Target
from kubellm.autoscaler.backend import Endpoint as ScalerEndpoint
from kubellm.contracts import (
    FallbackTarget,
    engine_identity_json,
    engine_spec_json,
    fallback_target,
)
from kubellm.fleet.processes import CommandFor, Supervisor
from kubellm.gateway.discovery.base import Endpoint as GatewayEndpoint
from kubellm.gateway.discovery.base import ModelTarget
from kubellm.gateway.discovery.kubernetes import adapter_refs
from kubellm.sources import parse_source


def secret_env_var(ref: api.SecretKeyRef) -> str:
    """The environment variable holding a Secret key locally: fallback-api/api-key ->
    FALLBACK_API_API_KEY."""
    return re.sub(r"[^A-Za-z0-9]", "_", f"{ref.name}_{ref.key}").upper()


def _fallback(spec: api.LLMDeploymentSpec) -> FallbackTarget | None:
    """The fallback API, its key from the environment (`secret_env_var`)."""
    ref = spec.fallback.api_key_secret_ref if spec.fallback else None
    return fallback_target(spec.fallback, os.environ.get(secret_env_var(ref)) if ref else None)


def _events(manifest: api.LLMDeployment) -> bool:
    """Whether its engines publish KV-cache events (spec.routing.prefixIndex precise): each
    local replica then gets its own ports, which the gateway's endpoint carries."""
    return manifest.spec.routing.prefix_index == "precise"


@dataclass
class LocalDeployment:
    manifest: api.LLMDeployment
    autoscaler_status: dict[str, Any] = field(default_factory=dict)
    adapter_status: list[dict[str, Any]] | None = None  # status.adapters, by the autoscaler
    events: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.manifest.metadata.name


def _as_tuple(value: Any) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


class LocalRuntime:
    """Desired deployments, their processes, and the views the gateway and autoscaler read."""

    def __init__(
        self,
        supervisor: Supervisor,
        run_dir: Path,
        *,
        engine: str = "vllm",
        sim_time_scale: float = 1.0,
        sim_profile: str | Sequence[str] | None = None,
        sim_slowdown: float | Sequence[float] | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.run_dir = run_dir
        self.engine = engine
        self.sim_time_scale = sim_time_scale
        self.sim_profiles = _as_tuple(sim_profile)
        self.sim_slowdowns = _as_tuple(sim_slowdown)
        self.deployments: dict[str, LocalDeployment] = {}

    # ------------------------------------------------------------------ apply

    def apply(self, manifests: list[api.LLMDeployment]) -> list[str]:
        """Make these the desired deployments, like `kubectl apply` of the files.

        A deployment whose engine spec changed gets new processes; a replica count
        change scales; a deployment no longer listed is removed. Returns what changed.
        """
        changes = []
        wanted = {m.metadata.name: m for m in manifests}
        for name in list(self.deployments):
            if name not in wanted:
                self.supervisor.forget(name)
                del self.deployments[name]
                changes.append(f"{name} removed")
        for name, manifest in wanted.items():
            current = self.deployments.get(name)
            if current is None:
                self.deployments[name] = LocalDeployment(manifest)
                self.supervisor.set_command(name, self._command(manifest), _events(manifest))
                self.supervisor.set_replicas(name, manifest.spec.replicas)
                changes.append(f"{name} created with {manifest.spec.replicas} replica(s)")
                continue
            old = current.manifest
            current.manifest = manifest
            before = len(changes)
            if engine_identity_json(old) != engine_identity_json(manifest):
                self.supervisor.set_command(name, self._command(manifest), _events(manifest))
                changes.append(f"{name} engine spec changed: replacing replicas")
            elif engine_spec_json(old) != engine_spec_json(manifest):
                self._command(manifest)  # new replicas start with the adapters; running ones
                changes.append(f"{name} adapters changed: loaded at runtime, no restart")
            if old.spec.replicas != manifest.spec.replicas:
                self.supervisor.set_replicas(name, manifest.spec.replicas)
                changes.append(f"{name} scaled to {manifest.spec.replicas}")
            if len(changes) == before and old.spec != manifest.spec:
                changes.append(f"{name} updated")  # routing, fallback, SLO: the gateway follows
        return changes

    def _command(self, manifest: api.LLMDeployment) -> CommandFor:
        base = [sys.executable, "-m", "kubellm.cli", "engine"]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        spec_file = self.run_dir / f"{manifest.metadata.name}.json"
        spec_file.write_text(engine_spec_json(manifest))
        if self.engine == "sim":
            # The simulator reads the same spec file and simulates the engine fields it
            # models (kubellm.engine.sim_profiles.SPEC_FIELDS) on its hardware profile
            # (tiny-cpu for CPU deployments unless --sim-profile names one). Replica i
            # gets item i mod n of --sim-profile and of --sim-slowdown.
            extra = ["--time-scale", f"{self.sim_time_scale:g}", "--spec", str(spec_file)]
            return lambda index, port: [*base, "--backend", "sim", "--port", str(port),
                                        "--served-model-name", manifest.served_name,
                                        *extra, *self.sim_hardware(index)]  # fmt: skip
        return lambda _index, port: [*base, "--spec", str(spec_file), "--port", str(port),
                                    "--host", "127.0.0.1"]  # fmt: skip

    def sim_hardware(self, index: int) -> list[str]:
        """The simulator flags of replica `index`: its profile and slowdown, if given."""
        out = []
        if self.sim_profiles:
            out += ["--profile", self.sim_profiles[index % len(self.sim_profiles)]]
        if self.sim_slowdowns:
            factor = self.sim_slowdowns[index % len(self.sim_slowdowns)]
            if factor != 1:
                out += ["--slowdown", f"{factor:g}"]
        return out

    # ------------------------------------------------------------------ views

    def gateway_targets(self) -> dict[str, ModelTarget]:
        """What the gateway serves: per served model, the ready replicas and the settings."""
        targets = {}
        for deployment in self.deployments.values():
            manifest = deployment.manifest
            endpoints = tuple(
                GatewayEndpoint(
                    url=r.url, draining=r.state == "draining", kv_events_port=r.kv_events_port
                )
                for r in self.supervisor.endpoints(deployment.name)
                if r.state in ("ready", "draining")
            )
            targets[manifest.served_name] = ModelTarget(
                served_name=manifest.served_name,
                deployment=deployment.name,
                namespace=manifest.metadata.namespace,
                endpoints=endpoints,
                routing=manifest.spec.routing,
                fallback=_fallback(manifest.spec),
                slo=manifest.spec.slo,
                adapters=adapter_refs(manifest.spec),
            )
        return targets

    def tokenizers(self) -> dict[str, str]:
        """What the gateway hashes prompts with for each precise deployment (served name ->
        `--tokenizer` value): the simulator's own tokenization on simulated engines, the
        model's folder (file://) or Hugging Face id (hf://) on vLLM. pvc:// models have no
        local folder: they are scored approximately (a fallback counted by the gateway)."""
        out = {}
        for deployment in self.deployments.values():
            manifest = deployment.manifest
            if not _events(manifest):
                continue
            if self.engine == "sim":
                out[manifest.served_name] = "simulator"
                continue
            source = parse_source(manifest.spec.model.source)
            if source.scheme == "file":
                out[manifest.served_name] = str(Path(source.location).resolve())
            elif source.scheme == "hf":
                out[manifest.served_name] = source.location
        return out

    def desired_replicas(self, name: str) -> int:
        return self.supervisor.desired.get(name, 0)


class LocalBackend:
    """The autoscaler's `Backend` over the local runtime: /scale is the supervisor's count."""

    def __init__(self, runtime: LocalRuntime) -> None:
        self.runtime = runtime

    async def targets(self) -> list[Target]:
        out = []
        for deployment in self.runtime.deployments.values():
            spec = deployment.manifest.spec
            if spec.autoscaling is None or not spec.autoscaling.enabled:
                continue
            out.append(
                Target(
                    namespace=deployment.manifest.metadata.namespace,
                    name=deployment.name,
                    served_name=deployment.manifest.served_name,
                    replicas=self.runtime.desired_replicas(deployment.name),
                    autoscaling=spec.autoscaling,
                    status=dict(deployment.autoscaler_status),
                    has_fallback=spec.fallback is not None and bool(spec.fallback.url),
                )
            )
        return out

    async def adapter_targets(self) -> list[AdapterTarget]:
        return [
            AdapterTarget(
                namespace=d.manifest.metadata.namespace,
                name=d.name,
                served_name=d.manifest.served_name,
                adapters=tuple(a.name for a in d.manifest.spec.adapters),
                status=d.adapter_status,
            )
            for d in self.runtime.deployments.values()
            if d.manifest.spec.adapters or d.adapter_status
        ]

    async def endpoints(self, target: Target | AdapterTarget) -> list[ScalerEndpoint]:
        return [
            ScalerEndpoint(name=r.name, metrics_url=f"{r.url}/metrics", ready=r.state == "ready")
            for r in self.runtime.supervisor.endpoints(target.name)
            if r.state in ("starting", "ready", "crashed")
        ]

    async def write_replicas(self, target: Target, replicas: int) -> None:
        self.runtime.supervisor.set_replicas(target.name, replicas)

    async def write_status(self, target: Target, autoscaler: dict[str, Any]) -> None:
        status = self.runtime.deployments[target.name].autoscaler_status
        for key, value in autoscaler.items():
            if value is None:
                status.pop(key, None)
            else:
                status[key] = value

    async def write_adapters(
        self, target: AdapterTarget, adapters: list[dict[str, Any]] | None
    ) -> None:
        self.runtime.deployments[target.name].adapter_status = adapters

    async def record_event(self, target: Target, reason: str, message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {target.name}: {reason}: {message}"
        events = self.runtime.deployments[target.name].events
        events.append(line)
        del events[:-50]
        self.runtime.supervisor.event(f"autoscaler: {target.name}: {message}")
