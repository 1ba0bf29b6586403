"""Hardware/model profiles for the simulated engine.

A profile fixes one replica's KV pool (blocks x block size), its batching
limits and its step-time model:

    step seconds = step_base_s + prefill_token_s x prefill tokens
                   + decode_token_s x decode tokens

`llama-3.1-8b-h100` is derived from the capacity arithmetic in kubellm.capacity
and public figures:
- weights: Llama 3.1 8B in bf16, 16.06 GB; KV per token 2 x 32 layers x 8 KV
  heads x 128 x 2 B = 128 KiB (kubellm.capacity.known_model("llama-3.1-8b")).
- GPU: H100 SXM 80 GB, 3.35 TB/s HBM3, 989 TFLOPS dense bf16 (NVIDIA H100
  datasheet). KV pool = 80 GiB x 0.9 - weights = 57 GiB = about 29,000 blocks
  of 16 tokens.
- step base: one decode step streams all weights: 16.06 GB / 3.35 TB/s = 4.8 ms;
  at ~70% achieved bandwidth, 7 ms (vLLM's published 8B ITL at low batch is
  7-10 ms on H100).
- prefill: 2 x 8.03e9 FLOP per token at ~50% of 989 TFLOPS = 32 us per token.
- decode: each running sequence also reads its own KV (2,000 tokens x 128 KiB
  = 262 MB at 3.35 TB/s = 0.08 ms); 0.08 ms per decode token.

`llama-3.1-8b-a100`, `llama-3.1-8b-l4` and `llama-3.1-70b-4xh100` follow the same
arithmetic from their datasheets (`derived`: weights per GPU over ~70% of the HBM
bandwidth for the step base, 2 x params FLOP per prompt token at ~50% of the dense bf16
peak spread over the GPUs, 2,000 tokens of a sequence's KV per decode token; tensor
parallelism adds two all-reduces per layer per step and ~15% prefill loss). The formula
gives the H100 profile's figures within 5% (tested), so the profiles compare fairly.

`llama-3.1-405b-2x8xh100` adds pipeline parallelism (`derived(pipeline=2)`): a step visits
the two stages in turn and pays one hop between nodes. It is conservative: a real engine
keeps two batches in flight so both stages work at once, which this one-step-at-a-time
model does not.

`deepseek-v3-dp16-ep-2x8xh100` is one data-parallel attention rank of DeepSeek-V3 served
wide (DP 16 x EP 16 on 2 x 8 H100, each rank an endpoint of its own): its own weights and
KV pool per GPU, a step that streams them and pays the exposed part of the experts'
all-to-all (`_h100x16_deepseek_dp_ep` has the figures and sources).

`slowed(factor)` multiplies every step cost (a throttled card, a noisy neighbour):
`kubellm engine --slowdown 1.5`, `kubellm up --sim-slowdown 1,1.5`.

`tiny-cpu` mirrors the tiny checkpoint on vLLM's CPU backend here (block size
32, 1 GiB KV space, 1 KiB of KV per token). Step costs from
bench/engine_batching.py on a 2-core machine: 512 output tok/s at 1 stream
(~1.9 ms per step) and 5,248 tok/s at 32 streams (~6.1 ms per step), so
1.8 ms per step + 0.13 ms per decode token; prefill cost is a guess.

`from_spec` maps an LLMDeployment's engine fields onto a profile, so
`kubellm up --engine sim` simulates the spec it is given: the fields in
`SPEC_FIELDS` change the simulation; those in `IGNORED_FIELDS` do not, each
with the reason (the profile stands for the hardware and the model).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kubellm import api, capacity, kv_tiers


@dataclass(frozen=True)
class Profile:
    name: str
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    step_base_s: float
    prefill_token_s: float
    decode_token_s: float
    chunked_prefill: bool = True
    prefix_caching: bool = True
    source: str = ""
    max_loras: int = 0  # LoRA adapter slots of one step; 0: LoRA off
    lora_load_s: float = 0.05  # loading one adapter into a slot (see LORA_LOAD_NOTE)
    # KV offload tiers (spec.engine.kvOffload; engine_image/sim_tiers.py): 0 blocks, none.
    kv_bytes_per_token: int = 0  # the model's, for the bytes a reload moves
    host_tier_blocks: int = 0
    disk_tier_blocks: int = 0
    host_gbps: float = kv_tiers.RELOAD_GBPS[kv_tiers.CPU]  # PCIe (kubellm.kv_tiers cites)
    disk_read_gbps: float = kv_tiers.RELOAD_GBPS[kv_tiers.STORAGE]  # local NVMe
    disk_write_gbps: float = kv_tiers.STORE_GBPS[kv_tiers.STORAGE]
    # P/D: the link a prefill role's KV reaches a decode role over, GB/s (capacity.KV_LINK_GBPS
    # has NVLink, RDMA and TCP figures; spec.prefill.kvConnector.linkBandwidthGBps sets it)
    kv_link_gbps: float = capacity.KV_LINK_GBPS["rdma"]

    def kv_transfer_seconds(self, tokens: int) -> float:
        """Moving `tokens` tokens' KV from a prefill replica over the link."""
        return self.kv_bytes_per_token * tokens / (self.kv_link_gbps * 1e9)

    def step_seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        return (
            self.step_base_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_token_s * decode_tokens
        )

    def slowed(self, factor: float, flag: str = "--slowdown") -> Profile:
        """This profile with every step cost multiplied by `factor` (1: unchanged): a
        slower card (`--slowdown`) or a bad revision on purpose (`--slow-steps`); an
        error names `flag`."""
        if not factor > 0 or factor == float("inf"):
            raise ValueError(f"{flag} must be a positive number, not {factor!r}")
        if factor == 1:
            return self
        return replace(
            self,
            name=f"{self.name}x{factor:g}",
            step_base_s=self.step_base_s * factor,
            prefill_token_s=self.prefill_token_s * factor,
            decode_token_s=self.decode_token_s * factor,
            source=f"{self.source}; every step cost x{factor:g}",
        )

    def with_overrides(self, **changes: int | float | bool | None) -> Profile:
        """A copy with the given fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


# A rank-16 adapter on every linear layer of Llama 3.1 8B holds 16 x (in + out) weights
# per projection: 1.31 M per layer, 42 M over 32 layers, 84 MB in bf16. vLLM keeps
# `max_cpu_loras` (default: max_loras) adapters in host memory, so one swapped out of its
# slot is read from disk again: ~40 ms at 2 GB/s from local NVMe, plus the copy to the GPU
# (~3 ms at 25 GB/s) and safetensors parsing: 50 ms. The tiny checkpoint's adapters are
# a few hundred KB: 5 ms.
LORA_LOAD_NOTE = "rank-16 Llama 3.1 8B adapter, 84 MB read from local NVMe"


def _h100_8b() -> Profile:
    shape = capacity.known_model("llama-3.1-8b")
    weights = capacity.weight_bytes(shape.params, "bf16")
    per_token = capacity.kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, 2)
    pool = capacity.kv_pool_bytes(80 * capacity.GIB, 0.9, weights)
    block_size = 16
    return Profile(
        name="llama-3.1-8b-h100",
        block_size=block_size,
        num_blocks=pool // (per_token * block_size),
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        step_base_s=0.007,
        prefill_token_s=32e-6,
        decode_token_s=80e-6,
        kv_bytes_per_token=per_token,
        source="kubellm.capacity + NVIDIA H100 SXM datasheet (3.35 TB/s, 989 TFLOPS bf16)",
    )


# Achieved shares of the datasheet peaks, as in the H100 profile: decode reaches ~70% of
# HBM bandwidth, prefill ~50% of dense bf16 FLOPs; a sequence's own KV read per decode
# token is taken at a 2,000-token context.
BANDWIDTH_SHARE = 0.7
FLOPS_SHARE = 0.5
DECODE_CONTEXT_TOKENS = 2000
# Tensor parallel: two all-reduces per layer per step (after attention and after the MLP),
# ~10 us each on NVLink at decode batch sizes (NCCL all-reduce latency, 4 x H100 SXM);
# prefill loses ~15% to the same all-reduces on larger messages.
ALLREDUCE_S = 10e-6
TP_PREFILL_EFFICIENCY = 0.85
# Pipeline parallel across nodes: a step visits the stages in turn (each streams its share
# of the weights), with one send of the activations between stages over the network
# (kubellm.capacity.Interconnect: ~15 us on 400 Gb/s InfiniBand or RoCE).
PIPELINE_HOP_S = capacity.Interconnect().inter_node_latency_s


def derived(
    name: str,
    model: str | capacity.ModelShape,
    *,
    gpus: int,
    gpu_gib: float,
    bandwidth_gbps: float,
    bf16_tflops: float,
    source: str,
    block_size: int = 16,
    max_num_seqs: int = 256,
    pipeline: int = 1,
) -> Profile:
    """A profile from the datasheet figures of `gpus` GPUs serving `model` in bf16, in
    `pipeline` stages of gpus / pipeline tensor-parallel GPUs: the formula behind every
    named profile below, public so that a new GPU or model can be priced the same way."""
    shape = capacity.known_model(model) if isinstance(model, str) else model
    weights = capacity.weight_bytes(shape.params, "bf16")
    per_token = capacity.kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, 2)
    pool = capacity.kv_pool_bytes(gpus * gpu_gib * capacity.GIB, 0.9, weights)
    bandwidth = bandwidth_gbps * capacity.GB  # bytes/s of one GPU; weights split over gpus
    tensor = gpus // pipeline
    tp = tensor > 1
    step_base = pipeline * weights / gpus / (bandwidth * BANDWIDTH_SHARE)  # stages in turn
    step_base += 2 * shape.num_layers * ALLREDUCE_S if tp else 0.0
    step_base += (pipeline - 1) * PIPELINE_HOP_S
    prefill = 2 * shape.params / (tensor * bf16_tflops * 1e12 * FLOPS_SHARE)
    prefill /= TP_PREFILL_EFFICIENCY if tp else 1.0
    decode = DECODE_CONTEXT_TOKENS * per_token / tensor / bandwidth
    return Profile(
        name=name,
        block_size=block_size,
        num_blocks=pool // (per_token * block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        step_base_s=round(step_base, 5),
        prefill_token_s=round(prefill, 8),
        decode_token_s=round(decode, 7),
        source=source,
    )


def for_shape(
    shape: capacity.ModelShape,
    tensor: int,
    pipeline: int,
    *,
    gpu_gib: float,
    bandwidth_gbps: float,
    bf16_tflops: float,
    max_num_seqs: int = 256,
) -> Profile:
    """A replica of `shape` in bf16 on tensor x pipeline GPUs of the given datasheet, by the
    formula the named profiles are derived with (`kubellm plan --trace --compare-shapes`).
    CapacityError when the weights leave no KV pool."""
    profile = derived(
        f"{shape.name}-tp{tensor}-pp{pipeline}", shape, gpus=tensor * pipeline, gpu_gib=gpu_gib,
        bandwidth_gbps=bandwidth_gbps, bf16_tflops=bf16_tflops, pipeline=pipeline,
        max_num_seqs=max_num_seqs,
        source=f"kubellm.capacity + {tensor * pipeline} GPUs of {gpu_gib:g} GiB, "
        f"{bandwidth_gbps:g} GB/s, {bf16_tflops:g} TFLOPS bf16 (datasheet)",
    )  # fmt: skip
    if profile.num_blocks <= 0:
        raise capacity.CapacityError(f"weights do not fit TP {tensor} x PP {pipeline}")
    return profile


def _a100_8b() -> Profile:
    # NVIDIA A100 datasheet (SXM4 80 GB): 2,039 GB/s HBM2e, 312 TFLOPS dense bf16.
    # Step base 16.06 GB / (0.7 x 2,039 GB/s) = 11.3 ms; prefill 2 x 8.03e9 FLOP /
    # 156 TFLOPS = 103 us per token; decode 262 MB / 2,039 GB/s = 0.13 ms per token;
    # the pool as on the H100 (same memory): about 29,000 blocks.
    return derived(
        "llama-3.1-8b-a100", "llama-3.1-8b", gpus=1, gpu_gib=80, bandwidth_gbps=2039,
        bf16_tflops=312, source="kubellm.capacity + NVIDIA A100 SXM4 80 GB datasheet "
        "(2,039 GB/s, 312 TFLOPS bf16)",
    )  # fmt: skip


def _l4_8b() -> Profile:
    # NVIDIA L4 datasheet (24 GB GDDR6): 300 GB/s, 121 TFLOPS dense bf16 (242 is with
    # sparsity). Pool 24 GiB x 0.9 - 16.06 GB = 7.1 GB = about 3,400 blocks (54,000
    # tokens: 13 requests of 4,096 tokens); step base 16.06 GB / 210 GB/s = 76 ms;
    # prefill 16.06e9 FLOP / 60.5 TFLOPS = 265 us per token; decode 262 MB / 300 GB/s =
    # 0.87 ms per token.
    return derived(
        "llama-3.1-8b-l4", "llama-3.1-8b", gpus=1, gpu_gib=24, bandwidth_gbps=300,
        bf16_tflops=121, source="kubellm.capacity + NVIDIA L4 24 GB datasheet "
        "(300 GB/s, 121 TFLOPS bf16)",
    )  # fmt: skip


def _h100x4_70b() -> Profile:
    # Llama 3.1 70B in bf16 (141 GB of weights; KV 2 x 80 layers x 8 KV heads x 128 x 2 B
    # = 320 KiB per token) on 4 x H100 SXM 80 GB, tensor parallel 4. Pool 4 x 80 GiB x 0.9
    # - 141 GB = 168 GB = about 32,000 blocks. Step base: each GPU streams a quarter of the
    # weights, 35.3 GB / (0.7 x 3.35 TB/s) = 15.1 ms, plus 160 all-reduces x 10 us = 16.7
    # ms (published 70B TP4 H100 ITL at low batch: 15-20 ms); prefill 2 x 70.6e9 FLOP /
    # (4 x 494 TFLOPS x 0.85) = 84 us per token; decode 2,000 x 320 KiB / 4 / 3.35 TB/s =
    # 0.05 ms per token.
    return derived(
        "llama-3.1-70b-4xh100", "llama-3.1-70b", gpus=4, gpu_gib=80, bandwidth_gbps=3350,
        bf16_tflops=989, source="kubellm.capacity + NVIDIA H100 SXM datasheet x 4, tensor "
        "parallel (3.35 TB/s, 989 TFLOPS bf16 each)",
    )  # fmt: skip


def _h100x16_405b() -> Profile:
    # Llama 3.1 405B in bf16 (812 GB of weights; KV 2 x 126 layers x 8 KV heads x 128 x 2 B
    # = 504 KiB per token) on 2 nodes of 8 H100 SXM 80 GB: tensor parallel 8 in a node,
    # pipeline parallel 2 across. Pool 16 x 80 GiB x 0.9 - 812 GB = 425 GB = about 51,000
    # blocks. Step base: two stages in turn, each GPU streaming 1/16 of the weights,
    # 2 x 50.7 GB / (0.7 x 3.35 TB/s) = 43.3 ms, plus 252 all-reduces x 10 us and one hop
    # of 15 us = 45.8 ms (published 405B bf16 ITL on 2 x 8 H100 at low batch: 40-60 ms);
    # prefill 2 x 405.9e9 FLOP / (8 x 494 TFLOPS x 0.85) = 242 us per token (a chunk
    # visits both stages in turn); decode 2,000 x 504 KiB / 8 / 3.35 TB/s = 0.04 ms.
    return derived(
        "llama-3.1-405b-2x8xh100", "llama-3.1-405b", gpus=16, gpu_gib=80,
        bandwidth_gbps=3350, bf16_tflops=989, pipeline=2,
        source="kubellm.capacity + NVIDIA H100 SXM datasheet x 16, tensor parallel 8 x "
        "pipeline parallel 2 (3.35 TB/s, 989 TFLOPS bf16 each)",
    )  # fmt: skip


# DeepSeek-V3 (DeepSeek-V3 technical report, arXiv 2412.19437, and its config.json): 671 B
# parameters, 37 B active per token, 61 layers (the first 3 dense, 58 MoE with 256 routed
# experts of intermediate size 2,048 on a hidden size of 7,168, 8 active per token, plus
# one shared expert), weights in FP8 (1 byte each). MLA caches one 512-dim latent plus a
# 64-dim rotary key per layer and token: 61 x 576 x 2 B = 70,272 B in bf16, which is
# kubellm.capacity's formula with one "KV head" of 288 dims (K and V counted twice).
DEEPSEEK_V3_PARAMS = 671e9
DEEPSEEK_V3_ACTIVE_PARAMS = 37e9
DEEPSEEK_V3_LAYERS = 61
DEEPSEEK_V3_ROUTED_EXPERT_PARAMS = 256 * 58 * 3 * 7168 * 2048  # 653.9 B
# DeepEP's published low-latency kernels (github.com/deepseek-ai/DeepEP README, H800 with
# 400 Gb/s CX7 InfiniBand, 128 tokens per batch, 8 experts each, hidden 7,168): EP16
# dispatch ~173 us and combine ~314 us per MoE layer.
EP16_DISPATCH_S, EP16_COMBINE_S = 173e-6, 314e-6
# DeepSeek's inference system overlaps the all-to-all with compute on a second micro-batch
# (two-batch overlap, "DeepSeek-V3/R1 Inference System Overview", 2025): we count half of
# it as exposed.
EP_EXPOSED_SHARE = 0.5


def _h100x16_deepseek_dp_ep() -> Profile:
    # One data-parallel attention rank (TP 1) of DeepSeek-V3 served wide on 2 nodes of 8
    # H100 SXM 80 GB: DP 16 x EP 16. Each GPU holds the non-expert weights whole (671 B -
    # 653.9 B routed = 17.1 B: attention, the dense layers, shared experts, embeddings) and
    # a 16th of the routed experts (40.9 B): 58.0 GB in FP8. KV pool 80 GiB x 0.9 - 58.0 GB
    # = 19.3 GB = 275,000 tokens = about 17,000 blocks of 16, its own (every rank is a
    # replica to the gateway). Step base: the rank streams its weights, 58.0 GB / (0.7 x
    # 3.35 TB/s) = 24.7 ms (at decode batches every local expert is hit), plus the exposed
    # half of 58 dispatch + combine all-to-alls, 58 x 487 us / 2 = 14.1 ms: 38.9 ms,
    # 26 tokens/s per stream (DeepSeek reports 20-22 tokens/s per user for its own
    # deployment, at larger batches). Prefill 2 x 37 B active FLOP per token at ~50% of
    # 1,979 TFLOPS dense FP8 = 75 us per token; decode: 2,000 tokens of latent KV, 2,000 x
    # 70,272 B / 3.35 TB/s = 0.04 ms per token.
    gpu, gpus = capacity.GIB * 80, 16
    local = DEEPSEEK_V3_PARAMS - DEEPSEEK_V3_ROUTED_EXPERT_PARAMS * (1 - 1 / gpus)
    weights = capacity.weight_bytes(local, "fp8")
    per_token = capacity.kv_bytes_per_token(DEEPSEEK_V3_LAYERS, 1, 288, 2)
    pool = capacity.kv_pool_bytes(gpu, 0.9, weights)
    bandwidth = 3350 * capacity.GB
    all_to_all = (DEEPSEEK_V3_LAYERS - 3) * (EP16_DISPATCH_S + EP16_COMBINE_S)
    step_base = weights / (bandwidth * BANDWIDTH_SHARE) + EP_EXPOSED_SHARE * all_to_all
    return Profile(
        name="deepseek-v3-dp16-ep-2x8xh100",
        block_size=16,
        num_blocks=pool // (per_token * 16),
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        step_base_s=round(step_base, 5),
        prefill_token_s=round(2 * DEEPSEEK_V3_ACTIVE_PARAMS / (1979e12 * FLOPS_SHARE), 8),
        decode_token_s=round(DECODE_CONTEXT_TOKENS * per_token / bandwidth, 7),
        source="one DP-attention rank of DeepSeek-V3 (FP8, MLA) at DP 16 x EP 16 on 2 x 8 "
        "H100 SXM: DeepSeek-V3 report + config, NVIDIA H100 datasheet (3.35 TB/s, 1,979 "
        "TFLOPS FP8), DeepEP's EP16 all-to-all latencies",
    )


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        _h100_8b(),
        _a100_8b(),
        _l4_8b(),
        _h100x4_70b(),
        _h100x16_405b(),
        _h100x16_deepseek_dp_ep(),
        Profile(
            name="tiny-cpu",
            block_size=32,  # vLLM's CPU attention needs a multiple of 32
            num_blocks=(1 * capacity.GIB) // (2 * 2 * 1 * 64 * 4 * 32),
            max_num_seqs=16,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            step_base_s=0.0018,
            prefill_token_s=20e-6,
            decode_token_s=0.13e-3,
            lora_load_s=0.005,
            source="the tiny checkpoint on vLLM CPU (bench/engine_batching.py)",
        ),
    )
}


def get(name: str) -> Profile:
    """The profile called `name`; ValueError naming --profile and the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"--profile {name!r} is unknown; known profiles: {', '.join(sorted(PROFILES))}"
        ) from None


def default_for(cpu: bool) -> str:
    """The profile for a spec that names none: the tiny CPU one for CPU engines."""
    return "tiny-cpu" if cpu else "llama-3.1-8b-h100"


# vLLM's KV block size when the spec sets none: 16 on GPUs, 128 on its CPU backend
# (vllm/platforms/cpu.py). A simulator at another block size counts other prefix hits.
VLLM_DEFAULT_BLOCK_SIZE_GPU = 16
VLLM_DEFAULT_BLOCK_SIZE_CPU = 128

# Engine fields (their manifest names) the simulator honours, and how.
SPEC_FIELDS: dict[str, str] = {
    "maxModelLen": "context length cap (the profile's when unset)",
    "maxNumSeqs": "sequences running at once; the rest queue (the profile's when unset)",
    "blockSize": "KV block size; the pool keeps its bytes (unset: vLLM's default, "
    f"{VLLM_DEFAULT_BLOCK_SIZE_GPU} on GPUs, {VLLM_DEFAULT_BLOCK_SIZE_CPU} on CPU)",
    "prefixCaching": "prefix cache on or off",
    "chunkedPrefill.enabled": "long prompts split across steps, or wait for a whole budget",
    "chunkedPrefill.maxNumBatchedTokens": "token budget of one step",
    "maxLoras": "adapter slots of one step, LRU, each load costs the profile's lora_load_s "
    "(unset with spec.adapters: kubellm's default, 4)",
    "kvOffload.hostGiB": "host-memory tier of evicted blocks, LRU, reloaded over PCIe "
    "(engine_image/sim_tiers.py; needs the profile's KV bytes per token)",
    "kvOffload.disk.sizeGiB": "disk tier below the host tier, LRU, reloaded from NVMe",
    "kvOffload.disk.claimName": "where the disk tier lives; the simulator keeps it in memory",
}
# Engine fields the simulator ignores, and why.
IGNORED_FIELDS: dict[str, str] = {
    "image": "no container runs",
    "dtype": "step costs come from the profile",
    "quantization": "step costs come from the profile",
    "kvCacheDtype": "the KV pool comes from the profile (--num-blocks resizes it)",
    "gpuMemoryUtilization": "the KV pool comes from the profile (--num-blocks resizes it)",
    "tensorParallelSize": "step costs and the KV pool come from the profile",
    "pipelineParallelSize": "step costs and the KV pool come from the profile",
    "dataParallelSize": "one simulated replica is one engine; step costs come from the profile",
    "expertParallel": "step costs come from the profile",
    "speculative": "one token per step; speculative decoding is not modelled",
    "port": "the simulator listens on --port",
    "extraArgs": "vLLM flags, not interpreted",
    "maxLoraRank": "an adapter's load time comes from the profile",
}


def from_spec(base: Profile, engine: api.EngineSpec, *, cpu: bool) -> Profile:
    """`base` with the engine fields of a spec that the simulator models (`SPEC_FIELDS`).

    ValueError, naming the field, for a combination vLLM would refuse at start-up."""
    default_block = VLLM_DEFAULT_BLOCK_SIZE_CPU if cpu else VLLM_DEFAULT_BLOCK_SIZE_GPU
    block_size = engine.block_size or default_block
    chunked = engine.chunked_prefill
    profile = replace(
        base,
        block_size=block_size,
        num_blocks=max(1, base.num_blocks * base.block_size // block_size),
        max_num_seqs=engine.max_num_seqs or base.max_num_seqs,
        max_model_len=engine.max_model_len or base.max_model_len,
        max_num_batched_tokens=chunked.max_num_batched_tokens,
        chunked_prefill=chunked.enabled,
        prefix_caching=engine.prefix_caching,
        max_loras=engine.max_loras or base.max_loras,
    )
    offload = engine.kv_offload
    block_bytes = profile.kv_bytes_per_token * block_size
    if offload is not None and block_bytes:
        disk = offload.disk.size_gib if offload.disk else 0.0
        profile = replace(
            profile,
            host_tier_blocks=int(offload.host_gib * kv_tiers.GIB) // block_bytes,
            disk_tier_blocks=int(disk * kv_tiers.GIB) // block_bytes,
        )
    if not profile.chunked_prefill and profile.max_num_batched_tokens < profile.max_model_len:
        raise ValueError(
            f"spec.engine.chunkedPrefill.maxNumBatchedTokens {profile.max_num_batched_tokens} "
            f"is below the context length {profile.max_model_len} with chunked prefill off: "
            "long prompts could never run (set spec.engine.maxModelLen or raise the budget)"
        )
    return profile
