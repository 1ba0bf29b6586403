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
  non-draining replicas and each deployment's routing, fallback and SLO, and the
  latency prior: each simulated replica's profile, or the decode bound the operator
  would write in status.capacity);
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

from kubellm import api, capacity
from kubellm.autoscaler.backend import AdapterTarget, Target, target_for
from kubellm.autoscaler.backend import Endpoint as ScalerEndpoint
from kubellm.contracts import (
    DECODE_ROLE,
    PREFILL_ROLE,
    ROLLOUT_ACTION_ANNOTATION,
    ROLLOUT_ACTIONS,
    FallbackTarget,
    engine_identity_json,
    engine_spec_json,
    fallback_target,
    revision,
)
from kubellm.fleet.cores import omp_bind_env
from kubellm.fleet.processes import CommandFor, EnvFor, Supervisor, free_port
from kubellm.gateway.discovery.base import Endpoint as GatewayEndpoint
from kubellm.gateway.discovery.base import ModelTarget, StepCosts, canary_split, prefill_split
from kubellm.gateway.discovery.kubernetes import adapter_refs
from kubellm.operator import rollout
from kubellm.sources import parse_source

# The supervisor's key for a deployment's canary replicas (spec.rollout.strategy Canary).
CANARY_SUFFIX = "--canary"
# ... and for its prefill role's replicas (spec.prefill; the deployment's own key runs the
# decode role then). A canary revision runs the decode role only here, the prefill replicas
# the stable revision (the operator runs both roles of a canary in a cluster).
PREFILL_SUFFIX = "--prefill"
# With --engine sim, these annotations make a revision's simulated engines misbehave on
# purpose (kubellm engine --slow-steps / --fail-prompts-over): a bad revision to try a
# canary rollout on. Annotations are not part of the engine identity: change them together
# with a field that is (the model source) to start a revision.
SIM_SLOW_STEPS_ANNOTATION = "kubellm.io/sim-slow-steps"
SIM_FAIL_PROMPTS_OVER_ANNOTATION = "kubellm.io/sim-fail-prompts-over"


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


def _decode_bound(spec: api.LLMDeploymentSpec) -> float | None:
    """status.capacity.decodeTokensPerSecondBound as the operator would write it (None
    when the spec lacks the inputs: model.architecture, the GPU's memory and bandwidth)."""
    try:
        figures = capacity.for_spec(spec)
    except capacity.CapacityError:
        return None
    return (figures or {}).get("decodeTokensPerSecondBound")


@dataclass
class LocalDeployment:
    manifest: api.LLMDeployment
    autoscaler_status: dict[str, Any] = field(default_factory=dict)
    adapter_status: list[dict[str, Any]] | None = None  # status.adapters, by the autoscaler
    events: list[str] = field(default_factory=list)
    total: int = 0  # the /scale value (a canary rollout splits it)
    # During a canary rollout: the manifest the stable replicas still run (None: `manifest`).
    stable: api.LLMDeployment | None = None
    rollout_status: dict[str, Any] = field(default_factory=dict)  # status.rollout
    acted_action: str | None = None  # the rollout-action annotation already acted on
    prefill_total: int = 0  # spec.prefill.replicas, or the autoscaler's write of it
    prefill_spec: int | None = None  # spec.prefill.replicas as last applied
    prefill_runs: str = ""  # the engine identity the prefill replicas run

    @property
    def name(self) -> str:
        return self.manifest.metadata.name

    @property
    def prefill_key(self) -> str:
        return self.name + PREFILL_SUFFIX

    @property
    def canary_key(self) -> str:
        return self.name + CANARY_SUFFIX


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
            if name not in wanted:  # removed or renamed: its canary's replicas go too
                self.supervisor.forget(name)
                for key in (self.deployments[name].canary_key, self.deployments[name].prefill_key):
                    if key in self.supervisor.desired:
                        self.supervisor.forget(key)
                del self.deployments[name]
                changes.append(f"{name} removed")
        for name, manifest in wanted.items():
            current = self.deployments.get(name)
            if current is None:
                self.deployments[name] = LocalDeployment(manifest, total=manifest.spec.replicas)
                self.supervisor.set_command(
                    name, self._command(manifest), _events(manifest), self.replica_env(manifest)
                )
                self.supervisor.set_replicas(name, manifest.spec.replicas)
                changes.append(f"{name} created with {manifest.spec.replicas} replica(s)")
                changes.extend(self._apply_prefill(self.deployments[name]))
                continue
            old = current.manifest
            current.manifest = manifest
            before = len(changes)
            stable = current.stable or old
            canary = manifest.spec.rollout.strategy == "Canary"
            if canary and revision(stable) != revision(manifest):
                # the stable replicas keep their spec file and command; the canary's run the
                # new revision beside them (tend_rollout sizes both)
                if current.stable is None:
                    current.stable = old
                command = self._command(manifest, canary=True)
                self.supervisor.set_command(current.canary_key, command, _events(manifest),
                                            self.replica_env(manifest))  # fmt: skip
                changes.append(f"{name} revision {revision(manifest)}: starts as a canary "
                               f"beside {revision(stable)}")  # fmt: skip
            elif engine_identity_json(stable) != engine_identity_json(manifest):
                current.stable = None
                self.supervisor.forget(current.canary_key)
                self.supervisor.set_command(
                    name, self._command(manifest), _events(manifest), self.replica_env(manifest)
                )
                changes.append(f"{name} engine spec changed: replacing replicas")
            elif current.stable is not None and canary:
                pass  # back to the stable revision's spec: tend_rollout ends the canary
            elif engine_spec_json(old) != engine_spec_json(manifest):
                self._command(manifest)  # new replicas start with the adapters; running ones
                changes.append(f"{name} adapters changed: loaded at runtime, no restart")
            if old.spec.replicas != manifest.spec.replicas:
                current.total = manifest.spec.replicas
                if current.stable is None:
                    self.supervisor.set_replicas(name, manifest.spec.replicas)
                changes.append(f"{name} scaled to {manifest.spec.replicas}")
            changes.extend(self._apply_prefill(current))
            if len(changes) == before and old.spec != manifest.spec:
                changes.append(f"{name} updated")  # routing, fallback, SLO: the gateway follows
        return changes

    def _apply_prefill(self, deployment: LocalDeployment) -> list[str]:
        """The prefill role's replicas (spec.prefill): started, replaced when the engine spec
        they run changes (during a canary rollout: the stable revision's, so a request's two
        legs stay on one revision; the canary's requests prefill locally), scaled when
        spec.prefill.replicas changes, or removed with spec.prefill."""
        manifest, key, name = deployment.manifest, deployment.prefill_key, deployment.name
        prefill = manifest.spec.prefill
        if prefill is None:
            if key not in self.supervisor.commands:
                return []
            self.supervisor.forget(key)
            deployment.prefill_total, deployment.prefill_runs, deployment.prefill_spec = 0, "", None
            return [f"{name} prefill role removed"]
        stable = deployment.stable
        runs = stable if stable is not None and stable.spec.prefill is not None else manifest
        if deployment.prefill_runs != engine_identity_json(runs):
            deployment.prefill_runs = engine_identity_json(runs)
            self.supervisor.set_command(key, self._command(runs, role="prefill"))
        if deployment.prefill_spec != prefill.replicas:
            deployment.prefill_spec = deployment.prefill_total = prefill.replicas
            self.supervisor.set_replicas(key, prefill.replicas)
            return [f"{name} prefill role at {prefill.replicas} replica(s)"]
        return []

    def _command(
        self, manifest: api.LLMDeployment, canary: bool = False, role: str | None = None
    ) -> CommandFor:
        base = [sys.executable, "-m", "kubellm.cli", "engine"]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        suffix = CANARY_SUFFIX if canary else ""
        if manifest.spec.prefill is not None:  # P/D: the deployment's own replicas decode
            role = role or "decode"
            base += ["--role", role]
            suffix += PREFILL_SUFFIX if role == "prefill" else ""
        spec_file = self.run_dir / f"{manifest.metadata.name}{suffix}.json"
        spec_file.write_text(engine_spec_json(manifest))
        if self.engine == "sim":
            # The simulator reads the same spec file and simulates the engine fields it
            # models (kubellm.engine.sim_profiles.SPEC_FIELDS) on its hardware profile
            # (tiny-cpu for CPU deployments unless --sim-profile names one). Replica i
            # gets item i mod n of --sim-profile and of --sim-slowdown.
            extra = ["--time-scale", f"{self.sim_time_scale:g}", "--spec", str(spec_file)]
            notes = manifest.metadata.model_extra or {}
            annotations = notes.get("annotations") or {}
            if annotations.get(SIM_SLOW_STEPS_ANNOTATION):
                extra += ["--slow-steps", str(annotations[SIM_SLOW_STEPS_ANNOTATION])]
            if annotations.get(SIM_FAIL_PROMPTS_OVER_ANNOTATION):
                extra += ["--fail-prompts-over",
                          str(annotations[SIM_FAIL_PROMPTS_OVER_ANNOTATION])]  # fmt: skip
            return lambda index, port: [*base, "--backend", "sim", "--port", str(port),
                                        "--served-model-name", manifest.served_name,
                                        *extra, *self.sim_hardware(index)]  # fmt: skip

        def vllm(_index: int, port: int) -> list[str]:
            # a P/D role's NIXL side channel: its own port (the pair shares one host)
            side = ["--kv-side-channel-port", str(free_port())] if role else []
            return [*base, "--spec", str(spec_file), "--port", str(port), "--host",
                    "127.0.0.1", *side]  # fmt: skip

        return vllm

    def replica_env(self, manifest: api.LLMDeployment) -> EnvFor | None:
        """Local vLLM CPU replicas share the machine's cores: each gets its own
        (`kubellm.fleet.cores`). P/D roles keep the launcher's binding (kv_transfer_env)."""
        if (self.engine != "vllm" or manifest.spec.resources.gpu.count != 0
                or manifest.spec.prefill is not None):  # fmt: skip
            return None
        return omp_bind_env

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

    def sim_step_costs(
        self, manifest: api.LLMDeployment, index: int, role: str | None = None
    ) -> StepCosts | None:
        """What a step of simulated replica `index` of `manifest` costs in wall seconds,
        as `kubellm engine --backend sim` picks its profile (`sim_hardware`, the spec's
        engine fields) and runs it at --time-scale: the slo-aware latency model's prior
        for it, exact. The sim-slow-steps annotation is left out: a revision that
        misbehaves on purpose is for the gateway to find, not to be told. None when the
        engine is not the simulator, the clock is virtual (scale 0) or the spec has no
        profile."""
        if self.engine != "sim" or not self.sim_time_scale > 0:
            return None
        from kubellm.engine import sim_profiles  # the composition root may import it
        from kubellm.engine.launcher import role_spec

        spec = role_spec(manifest.spec, role if manifest.spec.prefill is not None else None)
        cpu = spec.resources.gpu.count == 0
        names, slowdowns = self.sim_profiles, self.sim_slowdowns
        name = names[index % len(names)] if names else sim_profiles.default_for(cpu)
        try:
            profile = sim_profiles.from_spec(sim_profiles.get(name), spec.engine, cpu=cpu)
            if slowdowns:
                profile = profile.slowed(slowdowns[index % len(slowdowns)])
        except ValueError:
            return None  # the replica refuses to start; it never serves
        scale = self.sim_time_scale
        return StepCosts(
            step_base_s=profile.step_base_s * scale,
            prefill_token_s=profile.prefill_token_s * scale,
            decode_token_s=profile.decode_token_s * scale,
            max_num_batched_tokens=profile.max_num_batched_tokens,
        )

    # ------------------------------------------------------------------ canary rollouts

    def _ready(self, key: str) -> bool:
        """All of a supervisor deployment's wanted replicas are ready (at least one)."""
        want = self.supervisor.desired.get(key, 0)
        ready = [r for r in self.supervisor.endpoints(key) if r.state == "ready"]
        starting = [r for r in self.supervisor.endpoints(key)
                    if r.state not in ("ready", "draining")]  # fmt: skip
        return want > 0 and len(ready) >= want and not starting

    def tend_rollout(
        self, counters: dict[str, dict[str, rollout.Counters]] | None, now: float
    ) -> list[str]:
        """One step of every canary rollout, as the operator takes it (`rollout.decide`):
        `counters` are the gateway's per-revision counters by served name (None: unknown).
        Returns the events, as lines."""
        lines = []
        for d in self.deployments.values():
            manifest = d.manifest
            active = d.stable is not None or d.rollout_status.get("phase") == "Promoting"
            if manifest.spec.rollout.strategy != "Canary" and not active:
                d.rollout_status = {}
                continue
            notes = (manifest.metadata.model_extra or {}).get("annotations") or {}
            action = notes.get(ROLLOUT_ACTION_ANNOTATION)
            if action != d.acted_action and d.acted_action is not None:
                d.acted_action = None  # the annotation changed or went: a new one may act
            fresh = action if action in ROLLOUT_ACTIONS and action != d.acted_action else None
            spec = manifest.spec.model_copy(update={"replicas": d.total})
            stable = d.stable or manifest
            seen = rollout.Observation(
                desired_revision=revision(manifest),
                stable_revision=revision(stable),
                stable_ready=self._ready(d.name) or d.total == 0,
                canary_ready=self._ready(d.canary_key),
                now=now,
                counters=None if counters is None else counters.get(manifest.served_name, {}),
                action=fresh,
            )
            decision = rollout.decide(spec, d.rollout_status, seen)
            if decision.clear_action:
                d.acted_action = fresh
            d.rollout_status = {k: v for k, v in decision.status.items() if v is not None}
            if decision.mode == "canary":
                self.supervisor.set_replicas(d.name, decision.stable_replicas)
                self.supervisor.set_replicas(d.canary_key, decision.canary_replicas)
            elif decision.mode == "promoting":
                if d.stable is not None:  # the stable replicas take the revision now
                    d.stable = None
                    self.supervisor.set_command(d.name, self._command(manifest),
                                                _events(manifest))  # fmt: skip
                self.supervisor.set_replicas(d.name, d.total)
                self.supervisor.set_replicas(d.canary_key, decision.canary_replicas)
            else:
                if d.canary_key in self.supervisor.commands:
                    self.supervisor.forget(d.canary_key)
                if d.stable is not None:  # the spec went back to the stable revision
                    d.stable = None
                self.supervisor.set_replicas(d.name, d.total)
            for change in self._apply_prefill(d):  # it follows the stable revision
                self.supervisor.event(f"rollout: {change}")
            for kind, reason, message in decision.events:
                lines.append(f"rollout: {d.name}: {reason}: {message}")
                self.supervisor.event(f"rollout: {d.name}: {kind} {reason}: {message}")
        return lines

    # ------------------------------------------------------------------ views

    def gateway_targets(self) -> dict[str, ModelTarget]:
        """What the gateway serves: per served model, the ready replicas and the settings;
        during a canary rollout the canary's replicas too, with their revision and the split."""
        targets = {}
        for deployment in self.deployments.values():
            manifest = deployment.manifest
            canary_revision = revision(manifest)
            runs = {deployment.name: deployment.stable or manifest, deployment.canary_key: manifest}
            split = prefill_split(manifest.spec)
            roles = {key: DECODE_ROLE if split else None for key in runs}
            if split is not None:
                stable = deployment.stable
                runs[deployment.prefill_key] = (
                    stable if stable is not None and stable.spec.prefill is not None else manifest
                )
                roles[deployment.prefill_key] = PREFILL_ROLE
            endpoints = tuple(
                GatewayEndpoint(
                    url=r.url, draining=r.state == "draining", kv_events_port=r.kv_events_port,
                    revision=canary_revision if key == deployment.canary_key else None,
                    step_costs=self.sim_step_costs(spec, r.index, roles[key]),
                    role=roles[key],
                )
                for key, spec in runs.items()
                for r in self.supervisor.endpoints(key)
                if r.state in ("ready", "draining")
            )  # fmt: skip
            targets[manifest.served_name] = ModelTarget(
                served_name=manifest.served_name,
                deployment=deployment.name,
                namespace=manifest.metadata.namespace,
                endpoints=endpoints,
                routing=manifest.spec.routing,
                fallback=_fallback(manifest.spec),
                slo=manifest.spec.slo,
                adapters=adapter_refs(manifest.spec),
                canary=canary_split(deployment.rollout_status),
                decode_tokens_per_second_bound=_decode_bound(manifest.spec),
                prefill=split,
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
        """The /scale value (a canary rollout splits it between the revisions)."""
        deployment = self.deployments.get(name)
        if deployment is None:
            return self.supervisor.desired.get(name, 0)
        return deployment.total

    def scale(self, name: str, replicas: int) -> None:
        """Write /scale: the stable replicas follow at once unless a rollout splits them."""
        deployment = self.deployments[name]
        deployment.total = replicas
        if deployment.stable is None and not deployment.rollout_status.get("canaryRevision"):
            self.supervisor.set_replicas(name, replicas)


class LocalBackend:
    """The autoscaler's `Backend` over the local runtime: /scale is the supervisor's count."""

    def __init__(self, runtime: LocalRuntime) -> None:
        self.runtime = runtime

    async def targets(self) -> list[Target]:
        out = []
        for deployment in self.runtime.deployments.values():
            target = target_for(
                deployment.manifest,
                dict(deployment.autoscaler_status),
                self.runtime.desired_replicas(deployment.name),
                deployment.prefill_total,
            )
            if target is not None:
                out.append(target)
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
        return self._endpoints(target.name)

    def _endpoints(self, key: str) -> list[ScalerEndpoint]:
        return [
            ScalerEndpoint(name=r.name, metrics_url=f"{r.url}/metrics", ready=r.state == "ready")
            for r in self.runtime.supervisor.endpoints(key)
            if r.state in ("starting", "ready", "crashed")
        ]

    async def write_replicas(self, target: Target, replicas: int) -> None:
        self.runtime.scale(target.name, replicas)

    async def prefill_endpoints(self, target: Target) -> list[ScalerEndpoint]:
        return self._endpoints(self.runtime.deployments[target.name].prefill_key)

    async def write_prefill_replicas(self, target: Target, replicas: int) -> None:
        deployment = self.runtime.deployments[target.name]
        deployment.prefill_total = replicas
        self.runtime.supervisor.set_replicas(deployment.prefill_key, replicas)

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
