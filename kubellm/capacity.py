"""Capacity arithmetic for LLM serving: pure functions, no I/O.

The physics (see docs/architecture.md): every running request holds KV cache,
2 (K and V) x layers x KV heads x head dim x bytes per value, per token; the
KV pool is the usable GPU memory minus the weights, and that pool caps
concurrency. Decode streams all weights through memory once per step, so one
stream is bounded by bandwidth / weight bytes. Cost per token follows from
the GPU's hourly price, the sustained throughput and the utilization.

Units: bytes are bytes; GiB = 2**30 bytes, GB = 10**9 bytes; bandwidth is
given in GB/s (decimal, as vendors quote it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kubellm import kv_tiers

if TYPE_CHECKING:
    from kubellm import api

GIB = 2**30
GB = 10**9
# A KV cache's link from a prefill to a decode replica, GB/s one way, as achieved rather
# than signalled: NVLink 4 within an H100 node (900 GB/s both ways, NVIDIA H100 datasheet;
# NIXL over UCX's cuda_ipc reaches ~80% of a direction), RDMA over one 400 Gb/s
# ConnectX-7 NIC per GPU (50 GB/s line rate, ~45 achieved with GPUDirect), TCP over a
# 100 GbE pod network (12.5 GB/s line rate, ~10 achieved by one stream).
KV_LINK_GBPS = {"nvlink": 360.0, "rdma": 45.0, "tcp": 10.0}
# The transport each KV connector uses where spec.prefill.kvConnector does not give the
# link's bandwidth (others: TCP)
CONNECTOR_LINK = {"Nixl": "rdma", "Mooncake": "rdma", "P2pNccl": "rdma"}


def kv_link_gbps(connector: api.KVConnector) -> float:
    """The KV link's GB/s between a prefill and a decode pod: the connector's
    linkBandwidthGBps, else its transport's figure."""
    return connector.link_bandwidth_gbps or KV_LINK_GBPS[CONNECTOR_LINK.get(connector.type, "tcp")]


# Bits per weight, including the scale overhead of each format:
# - bf16/fp16: 16 bits, no scales.
# - fp8: 8 bits with one scale per tensor (or per channel): overhead below 0.01%,
#   taken as 0.
# - int8 (W8A8, per-channel scales): overhead below 0.01%, taken as 0.
# - int4 (GPTQ/AWQ style, group size 128 with a 16-bit scale and a 16-bit zero
#   point per group): 4 + 32/128 = 4.25 bits.
WEIGHT_BITS: dict[str, float] = {
    "fp32": 32.0,
    "bf16": 16.0,
    "fp16": 16.0,
    "fp8": 8.0,
    "int8": 8.0,
    "int4": 4.25,
}

# Bytes per KV value for each cache dtype.
KV_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

_TORCH_DTYPES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
}


class CapacityError(ValueError):
    """An impossible plan; the message says what to change."""


@dataclass(frozen=True)
class ModelShape:
    """What capacity arithmetic needs to know about a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    params: float  # parameter count
    dtype: str = "bf16"  # weight dtype, a key of WEIGHT_BITS
    max_context: int | None = None  # max_position_embeddings, when known
    name: str = "custom"
    num_attention_heads: int | None = None  # query heads, when known (tensor-parallel check)
    expert_fraction: float = 0.0  # share of the parameters in MoE experts (0: dense)

    @property
    def hidden_size(self) -> int | None:
        """The residual stream's width (query heads x head dim), when the heads are known."""
        return self.num_attention_heads * self.head_dim if self.num_attention_heads else None


def estimate_params(config: Mapping[str, Any]) -> float:
    """Parameter count of a Llama-style decoder from its Hugging Face config.

    Attention (q, k, v, o projections), a gated MLP (3 matrices), two norms per
    layer, the embedding and, unless tied, the output head.
    """
    hidden = int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config.get("intermediate_size") or 4 * hidden)
    vocab = int(config["vocab_size"])
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * inter
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return float(layers * per_layer + embeddings + hidden)


def shape_from_hf_config(config: Mapping[str, Any], name: str = "custom") -> ModelShape:
    """Read a Hugging Face `config.json` (as a dict) into a ModelShape."""
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
    except KeyError as missing:
        raise CapacityError(f"model config lacks {missing.args[0]!r}") from None
    torch_dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return ModelShape(
        num_layers=layers,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        params=estimate_params(config),
        dtype=_TORCH_DTYPES.get(torch_dtype, "bf16"),
        max_context=config.get("max_position_embeddings"),
        name=name,
        num_attention_heads=heads,
    )


def _llama(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, ctx: int,
           tie: bool = False) -> dict[str, Any]:  # fmt: skip
    return {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": ctx,
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
    }


# Shapes of well-known open models, copied from their public config.json files.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "llama-2-7b": _llama(4096, 11008, 32, 32, 32, 32000, 4096),
    "llama-3.1-8b": _llama(4096, 14336, 32, 32, 8, 128256, 131072),
    "llama-3.1-70b": _llama(8192, 28672, 80, 64, 8, 128256, 131072),
    "llama-3.1-405b": _llama(16384, 53248, 126, 128, 8, 128256, 131072),
    "mistral-7b": _llama(4096, 14336, 32, 32, 8, 32000, 32768),
    "qwen2.5-7b": _llama(3584, 18944, 28, 28, 4, 152064, 32768),
}


def known_model(name: str) -> ModelShape:
    try:
        return shape_from_hf_config(KNOWN_MODELS[name], name=name)
    except KeyError:
        raise CapacityError(
            f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}"
        ) from None


# --------------------------------------------------------------------------- memory


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_bytes: int) -> int:
    """KV-cache bytes one token holds: 2 (K and V) x layers x KV heads x head dim x bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * kv_bytes


def kv_bytes_per_request(per_token: int, context_tokens: int) -> int:
    return per_token * context_tokens


def weight_bytes(params: float, dtype: str) -> int:
    """Bytes of weights for `params` parameters stored as `dtype` (scale overhead included)."""
    try:
        bits = WEIGHT_BITS[dtype]
    except KeyError:
        raise CapacityError(
            f"unknown weight dtype {dtype!r}; use one of {', '.join(WEIGHT_BITS)}"
        ) from None
    return round(params * bits / 8)


def kv_pool_bytes(gpu_memory_bytes: float, usable_fraction: float, weights: float) -> int:
    """Memory left for KV cache: usable GPU memory minus the weights."""
    if not 0 < usable_fraction <= 1:
        raise CapacityError(f"usable fraction must be in (0, 1], got {usable_fraction}")
    usable = gpu_memory_bytes * usable_fraction
    if weights >= usable:
        raise CapacityError(
            f"weights ({weights / GIB:.1f} GiB) do not fit in the usable GPU memory "
            f"({usable / GIB:.1f} GiB): quantize the weights (fp8, int8, int4), use a larger GPU, "
            f"or split the model across GPUs with tensor parallelism"
        )
    return round(usable - weights)


def max_concurrent_sequences(pool_bytes: int, per_request_bytes: int) -> int:
    """Requests of a given size whose KV cache fits in the pool at once."""
    if per_request_bytes <= 0:
        raise CapacityError("a request must hold at least one token")
    return pool_bytes // per_request_bytes


# --------------------------------------------------------------------------- speed and cost


def decode_tokens_per_second_bound(bandwidth_gbps: float, weights: float) -> float:
    """Upper bound on one stream's decode speed: every step reads all the weights."""
    return bandwidth_gbps * GB / weights


def tokens_per_hour(throughput_tps: float, utilization: float = 1.0) -> float:
    return throughput_tps * 3600 * utilization


def cost_per_million_tokens(
    gpu_hour_price: float, throughput_tps: float, utilization: float = 1.0
) -> float:
    """Dollars per million output tokens for a GPU sustaining `throughput_tps` at full load."""
    if throughput_tps <= 0 or not 0 < utilization <= 1:
        raise CapacityError("throughput must be positive and utilization in (0, 1]")
    return gpu_hour_price / tokens_per_hour(throughput_tps, utilization) * 1e6


def check_tensor_parallel(shape: ModelShape, tensor_parallel: int) -> None:
    """Refuse a tensor-parallel size vLLM would refuse for this model.

    vLLM splits the attention heads evenly across the GPUs of a replica, so the
    size must divide the attention heads; KV heads are split when there are at
    least as many as GPUs, else replicated, so one must divide the other.
    """
    if tensor_parallel < 1:
        raise CapacityError(f"--tensor-parallel must be at least 1, got {tensor_parallel}")
    heads = shape.num_attention_heads
    if heads and heads % tensor_parallel:
        sizes = [d for d in range(1, heads + 1) if heads % d == 0 and d <= 16]
        raise CapacityError(
            f"tensor parallel size {tensor_parallel} does not divide the model's {heads} "
            f"attention heads (vLLM requires it): use one of {', '.join(map(str, sizes))}"
        )
    kv = shape.num_kv_heads
    if (kv % tensor_parallel) if kv >= tensor_parallel else (tensor_parallel % kv):
        raise CapacityError(
            f"tensor parallel size {tensor_parallel} and the model's {kv} KV heads: one must "
            f"divide the other (vLLM splits or replicates KV heads): change the tensor parallel "
            f"size"
        )


def break_even_utilization(
    gpu_hour_price: float, throughput_tps: float, api_price_per_million: float
) -> float:
    """Utilization at which self-hosting costs the same per token as the API.

    Above it self-hosting is cheaper; a value over 1 means the API always wins.
    """
    return gpu_hour_price * 1e6 / (tokens_per_hour(throughput_tps) * api_price_per_million)


# --------------------------------------------------------------------------- a plan


@dataclass(frozen=True)
class Interconnect:
    """The links a replica's GPUs talk over, for the communication terms of a decode step.

    Defaults are an H100 node (NVLink 4: 450 GB/s each way; a small NCCL all-reduce costs
    about 8 us of latency) and a 400 Gb/s InfiniBand or RoCE network between nodes (50 GB/s,
    about 15 us per send). Decode messages are small, so latency dominates."""

    intra_node_gbps: float = 450.0
    intra_node_latency_s: float = 8e-6
    inter_node_gbps: float = 50.0
    inter_node_latency_s: float = 15e-6


@dataclass(frozen=True)
class Parallelism:
    """The shape of one replica: tensor x pipeline x data parallel ranks, one per GPU."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    expert: bool = False  # experts split over every rank (needs ModelShape.expert_fraction)

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline * self.data


def weight_bytes_per_gpu(weights: float, shape: ModelShape, par: Parallelism) -> float:
    """Weights one GPU holds: each DP rank a full copy split over TP x PP GPUs, except,
    with expert parallelism, the experts, which are split over all TP x PP x DP GPUs."""
    dense = weights * (1 - shape.expert_fraction) / (par.tensor * par.pipeline)
    experts = weights * shape.expert_fraction / (par.tensor * par.pipeline)
    return dense + (experts / par.data if par.expert else experts)


def kv_bytes_per_token_per_gpu(shape: ModelShape, kv_bytes: int, par: Parallelism) -> int:
    """KV one token holds on one GPU: its stage's layers (layers / PP, rounded up) and its
    share of the KV heads (split over TP, or one replicated head when TP exceeds them)."""
    layers = math.ceil(shape.num_layers / par.pipeline)
    heads = math.ceil(shape.num_kv_heads / par.tensor)
    return kv_bytes_per_token(layers, heads, shape.head_dim, kv_bytes)


def allreduce_seconds_per_token(
    shape: ModelShape, par: Parallelism, link: Interconnect, value_bytes: int = 2
) -> float:
    """Tensor parallelism's cost in one decode step of one sequence: two all-reduces per
    layer (after attention and after the MLP) of one hidden vector, each a latency plus a
    ring's 2 (TP - 1) / TP of the vector over NVLink. Zero without tensor parallelism."""
    if par.tensor == 1:
        return 0.0
    moved = 2 * (par.tensor - 1) / par.tensor * (shape.hidden_size or 0) * value_bytes
    return 2 * shape.num_layers * (link.intra_node_latency_s + moved / (link.intra_node_gbps * GB))


def pipeline_hop_seconds(
    shape: ModelShape, par: Parallelism, link: Interconnect, value_bytes: int = 2
) -> float:
    """Pipeline parallelism's cost in one decode step: PP - 1 sends of the activations
    between stages (across nodes)."""
    vector = (shape.hidden_size or 0) * value_bytes
    return (par.pipeline - 1) * (link.inter_node_latency_s + vector / (link.inter_node_gbps * GB))


def decode_step_seconds(
    shape: ModelShape, weights: float, bandwidth_gbps: float, par: Parallelism,
    link: Interconnect = Interconnect(),
) -> float:  # fmt: skip
    """One decode step of one sequence: each stage in turn streams its GPUs' weights (the
    stages run one after another for a token: a pipeline's bubble, which only PP batches in
    flight fill), plus the all-reduces and the hops between stages."""
    per_gpu = weight_bytes_per_gpu(weights, shape, par)
    streaming = par.pipeline * per_gpu / (bandwidth_gbps * GB)
    return (
        streaming
        + allreduce_seconds_per_token(shape, par, link)
        + pipeline_hop_seconds(shape, par, link)
    )


@dataclass(frozen=True)
class GPUProfile:
    memory_gib: float = 80.0
    usable_fraction: float = 0.9
    bandwidth_gbps: float = 2000.0
    hour_price: float | None = None


@dataclass(frozen=True)
class Workload:
    context_tokens: int = 4096
    concurrency: int | None = None
    throughput_tps: float | None = None
    utilization: float = 1.0
    api_price_per_million: float | None = None


@dataclass(frozen=True)
class Plan:
    model: str
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    weight_bytes: int
    kv_pool_bytes: int
    max_concurrent_sequences: int
    decode_tokens_per_second_bound: float
    gpus_per_replica: int
    replicas_needed: int | None
    cost_per_million_tokens: float | None
    break_even_utilization: float | None
    weight_bytes_per_gpu: int = 0
    kv_pool_bytes_per_gpu: int = 0
    allreduce_seconds_per_token: float = 0.0
    pipeline_hop_seconds: float = 0.0


def plan(
    shape: ModelShape,
    gpu: GPUProfile,
    workload: Workload,
    *,
    kv_dtype: str = "bf16",
    weights_override: int | None = None,
    tensor_parallel: int = 1,
    parallel: Parallelism | None = None,
    link: Interconnect = Interconnect(),
) -> Plan:
    """Size one replica (on `tensor_parallel` GPUs, or the TP x PP x DP GPUs of `parallel`)
    and the fleet for a workload. The KV pool is per GPU (usable memory less that GPU's
    weights); a sequence's KV is spread over one DP rank's TP x PP GPUs, so each DP rank
    holds pool / (KV per token per GPU x context) sequences."""
    par = parallel or Parallelism(tensor=tensor_parallel)
    tensor_parallel = par.tensor
    if workload.context_tokens < 1:
        raise CapacityError("context tokens must be at least 1")
    check_tensor_parallel(shape, tensor_parallel)
    if shape.max_context and workload.context_tokens > shape.max_context:
        raise CapacityError(
            f"context of {workload.context_tokens} tokens exceeds the model's maximum of "
            f"{shape.max_context}: lower --context-tokens"
        )
    per_token = kv_bytes_per_token(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, KV_BYTES[kv_dtype]
    )
    per_request = kv_bytes_per_request(per_token, workload.context_tokens)
    weights = (
        weights_override
        if weights_override is not None
        else weight_bytes(shape.params, shape.dtype)
    )
    per_gpu = weight_bytes_per_gpu(weights, shape, par)
    try:
        pool_per_gpu = kv_pool_bytes(gpu.memory_gib * GIB, gpu.usable_fraction, per_gpu)
    except CapacityError as error:
        raise CapacityError(
            f"{error}, or pipeline parallelism across nodes (the weights per GPU here: "
            f"{par.tensor} x {par.pipeline} GPUs share them)"
        ) from None
    pool = pool_per_gpu * par.gpus
    per_token_gpu = kv_bytes_per_token_per_gpu(shape, KV_BYTES[kv_dtype], par)
    seqs = par.data * max_concurrent_sequences(
        pool_per_gpu, per_token_gpu * workload.context_tokens
    )
    if seqs < 1:
        raise CapacityError(
            f"one {workload.context_tokens}-token request needs {per_request / GIB:.2f} GiB of KV "
            f"cache but the pool holds {pool / GIB:.2f} GiB: shorten the context, use an fp8 KV "
            f"cache, or add GPUs"
        )
    replicas = math.ceil(workload.concurrency / seqs) if workload.concurrency else None
    cost = break_even = None
    if gpu.hour_price is not None and workload.throughput_tps:
        fleet_price = gpu.hour_price * par.gpus
        cost = cost_per_million_tokens(fleet_price, workload.throughput_tps, workload.utilization)
        if workload.api_price_per_million:
            break_even = break_even_utilization(
                fleet_price, workload.throughput_tps, workload.api_price_per_million
            )
    return Plan(
        model=shape.name,
        kv_bytes_per_token=per_token,
        kv_bytes_per_request=per_request,
        weight_bytes=weights,
        kv_pool_bytes=pool,
        max_concurrent_sequences=seqs,
        decode_tokens_per_second_bound=1
        / decode_step_seconds(shape, weights, gpu.bandwidth_gbps, par, link),
        gpus_per_replica=par.gpus,
        replicas_needed=replicas,
        cost_per_million_tokens=cost,
        break_even_utilization=break_even,
        weight_bytes_per_gpu=round(per_gpu),
        kv_pool_bytes_per_gpu=pool_per_gpu,
        allreduce_seconds_per_token=allreduce_seconds_per_token(shape, par, link),
        pipeline_hop_seconds=pipeline_hop_seconds(shape, par, link),
    )


def for_spec(spec: Any) -> dict[str, Any] | None:
    """`status.capacity` for an `LLMDeploymentSpec`, or None when the spec lacks the inputs.

    Needs `model.architecture`, `resources.gpu.memoryGiB` and `engine.maxModelLen`;
    the decode bound also needs `resources.gpu.bandwidthGBps`.
    """
    arch = spec.model.architecture
    gpu = spec.resources.gpu
    engine = spec.engine
    if arch is None or gpu.memory_gib is None or engine.max_model_len is None:
        return None
    weight_dtype = {"fp8": "fp8", "awq": "int4", "gptq": "int4"}.get(engine.quantization or "")
    shape = ModelShape(
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        params=arch.params_billions * 1e9,
        dtype=weight_dtype or "bf16",
    )
    kv_dtype = "fp8" if engine.kv_cache_dtype.startswith("fp8") else "bf16"
    result = plan(
        shape,
        GPUProfile(
            memory_gib=gpu.memory_gib,
            usable_fraction=engine.gpu_memory_utilization,
            bandwidth_gbps=gpu.bandwidth_gbps or 1.0,
        ),
        Workload(context_tokens=engine.max_model_len),
        kv_dtype=kv_dtype,
        parallel=Parallelism(
            tensor=engine.tensor_parallel_size,
            pipeline=engine.pipeline_parallel_size,
            data=engine.data_parallel_size,
            expert=engine.expert_parallel,
        ),
    )
    out: dict[str, Any] = {
        "kvBytesPerToken": result.kv_bytes_per_token,
        "kvBytesPerRequest": result.kv_bytes_per_request,
        "weightBytes": result.weight_bytes,
        "kvPoolBytes": result.kv_pool_bytes,
        "maxConcurrentSequences": result.max_concurrent_sequences,
    }
    if result.gpus_per_replica > 1:
        out["weightBytesPerGPU"] = result.weight_bytes_per_gpu
        out["kvPoolBytesPerGPU"] = result.kv_pool_bytes_per_gpu
    if gpu.bandwidth_gbps:
        out["decodeTokensPerSecondBound"] = round(result.decode_tokens_per_second_bound, 1)
    offload = engine.kv_offload
    if offload is not None:  # each tier's capacity in tokens (one replica)
        tiers = kv_tiers.tier_capacity(
            result.kv_bytes_per_token, result.kv_pool_bytes, offload.host_gib,
            offload.disk.size_gib if offload.disk else 0.0,
        )  # fmt: skip
        out["kvTokensGPU"] = tiers.gpu_tokens
        out["kvTokensHost"] = tiers.host_tokens
        if offload.disk:
            out["kvTokensDisk"] = tiers.disk_tokens
    return out


def shapes(gpus_per_node: int, max_nodes: int) -> list[Parallelism]:
    """Replica shapes that use every GPU of 1..max_nodes nodes: tensor parallelism a power of
    two inside a node, pipeline stages for the rest (fewest nodes first, then least TP)."""
    out = []
    for nodes in range(1, max_nodes + 1):
        tensor = 1
        while tensor <= gpus_per_node:
            if gpus_per_node % tensor == 0:
                out.append(Parallelism(tensor=tensor, pipeline=nodes * gpus_per_node // tensor))
            tensor *= 2
    return out


def compare_shapes(
    shape: ModelShape, gpu: GPUProfile, workload: Workload, candidates: list[Parallelism],
    *, kv_dtype: str = "bf16", link: Interconnect = Interconnect(),
) -> list[tuple[Parallelism, Plan | str]]:  # fmt: skip
    """Each candidate's plan, or why it cannot run the model (the CapacityError's message)."""
    out: list[tuple[Parallelism, Plan | str]] = []
    for par in candidates:
        if par.pipeline > shape.num_layers:
            out.append((par, f"more stages ({par.pipeline}) than layers"))
            continue
        try:
            out.append((par, plan(shape, gpu, workload, kv_dtype=kv_dtype, parallel=par,
                                  link=link)))  # fmt: skip
        except CapacityError as error:
            out.append((par, str(error).split(":")[0]))
    return out
