"""Capacity arithmetic reproduces the serving lesson's figures exactly."""

from __future__ import annotations

import pytest

from kubellm import api, capacity, manifests
from kubellm.capacity import GB, GIB


def test_kv_bytes_per_token_32_kv_heads() -> None:
    assert capacity.kv_bytes_per_token(32, 32, 128, 2) == 524_288  # 0.5 MiB


def test_kv_per_4096_token_request_is_2_gib() -> None:
    per_token = capacity.kv_bytes_per_token(32, 32, 128, 2)
    assert capacity.kv_bytes_per_request(per_token, 4096) == 2 * GIB


def test_kv_pool_59_gib_on_80_gib_at_90_percent_with_13_gib_weights() -> None:
    assert capacity.kv_pool_bytes(80 * GIB, 0.9, 13 * GIB) == 59 * GIB


@pytest.mark.parametrize(("kv_heads", "requests"), [(32, 29), (8, 118)])
def test_concurrent_requests_fit(kv_heads: int, requests: int) -> None:
    per_request = capacity.kv_bytes_per_token(32, kv_heads, 128, 2) * 4096
    pool = capacity.kv_pool_bytes(80 * GIB, 0.9, 13 * GIB)
    assert capacity.max_concurrent_sequences(pool, per_request) == requests


def test_decode_bound_143_at_16_bit_and_286_at_8_bit() -> None:
    w16 = capacity.weight_bytes(7e9, "bf16")
    w8 = capacity.weight_bytes(7e9, "int8")
    assert w16 == 14 * GB and w8 == 7 * GB
    assert round(capacity.decode_tokens_per_second_bound(2000, w16)) == 143
    assert round(capacity.decode_tokens_per_second_bound(2000, w8)) == 286


def test_int4_weights_carry_group_scale_overhead() -> None:
    # 4 bits + a 16-bit scale and a 16-bit zero point per 128 weights = 4.25 bits.
    assert capacity.weight_bytes(8e9, "int4") == 8e9 * 4.25 / 8


def test_cost_per_million_tokens_at_full_and_30_percent_load() -> None:
    assert round(capacity.cost_per_million_tokens(2.0, 1000), 2) == 0.56
    assert round(capacity.cost_per_million_tokens(2.0, 1000, 0.3), 2) == 1.85


def test_break_even_utilization_matches_cost_curve() -> None:
    u = capacity.break_even_utilization(2.0, 1000, api_price_per_million=1.0)
    assert capacity.cost_per_million_tokens(2.0, 1000, u) == pytest.approx(1.0)


def test_llama_3_1_8b_parameter_count_from_config() -> None:
    shape = capacity.known_model("llama-3.1-8b")
    assert shape.params == 8_030_261_248  # the published count
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (32, 8, 128)


def test_shape_from_hf_config_defaults_kv_heads_and_head_dim() -> None:
    shape = capacity.shape_from_hf_config(
        {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 100}
    )
    assert (shape.num_kv_heads, shape.head_dim, shape.dtype) == (8, 64, "bf16")


def test_plan_for_the_lesson_example() -> None:
    shape = capacity.ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, params=7e9)
    result = capacity.plan(
        shape,
        capacity.GPUProfile(80, 0.9, 2000, hour_price=2.0),
        capacity.Workload(context_tokens=4096, concurrency=300, throughput_tps=1000),
        weights_override=13 * GIB,
    )
    assert result.max_concurrent_sequences == 118
    assert result.replicas_needed == 3
    assert round(result.cost_per_million_tokens, 2) == 0.56


def test_plan_rejects_weights_larger_than_the_gpu() -> None:
    with pytest.raises(capacity.CapacityError, match="quantize"):
        capacity.plan(
            capacity.known_model("llama-3.1-70b"), capacity.GPUProfile(80), capacity.Workload()
        )


def test_plan_rejects_context_over_the_model_maximum() -> None:
    with pytest.raises(capacity.CapacityError, match="maximum of 4096"):
        capacity.plan(
            capacity.known_model("llama-2-7b"), capacity.GPUProfile(), capacity.Workload(8192)
        )


def test_tensor_parallel_makes_70b_fit() -> None:
    result = capacity.plan(
        capacity.known_model("llama-3.1-70b"),
        capacity.GPUProfile(80),
        capacity.Workload(8192),
        tensor_parallel=2,
    )
    assert result.max_concurrent_sequences > 0 and result.gpus_per_replica == 2


def test_status_capacity_from_spec() -> None:
    doc = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "m"},
        "spec": {
            "model": {
                "source": "hf://a/b",
                "architecture": {
                    "numLayers": 32,
                    "numKVHeads": 32,
                    "headDim": 128,
                    "paramsBillions": 7,
                },
            },
            "engine": {"maxModelLen": 4096},
            "resources": {"gpu": {"memoryGiB": 80, "bandwidthGBps": 2000}},
        },
    }
    spec = manifests.parse(doc).spec
    out = capacity.for_spec(spec)
    assert out["kvBytesPerToken"] == 524_288
    assert out["kvBytesPerRequest"] == 2 * GIB
    assert out["decodeTokensPerSecondBound"] == pytest.approx(142.9)
    assert out["maxConcurrentSequences"] == (72 * GIB - 14 * GB) // (2 * GIB)
    doc["spec"]["engine"]["kvCacheDtype"] = "fp8"
    assert capacity.for_spec(manifests.parse(doc).spec)["kvBytesPerToken"] == 262_144
    del doc["spec"]["model"]["architecture"]
    assert capacity.for_spec(manifests.parse(doc).spec) is None


LLAMA_405B = capacity.ModelShape(
    num_layers=126, num_kv_heads=8, head_dim=128, params=405.9e9, num_attention_heads=128
)
H100 = capacity.GPUProfile(memory_gib=80, usable_fraction=0.9, bandwidth_gbps=3350)


def test_405b_needs_a_second_node_and_fits_with_pipeline_parallelism() -> None:
    with pytest.raises(capacity.CapacityError, match="pipeline parallelism"):
        capacity.plan(LLAMA_405B, H100, capacity.Workload(8192), tensor_parallel=8)
    shape = capacity.Parallelism(tensor=8, pipeline=2)
    result = capacity.plan(LLAMA_405B, H100, capacity.Workload(8192), parallel=shape)
    assert result.gpus_per_replica == 16
    assert result.weight_bytes_per_gpu == pytest.approx(result.weight_bytes / 16, abs=1)
    usable = 80 * GIB * 0.9
    assert result.kv_pool_bytes_per_gpu == round(usable - result.weight_bytes / 16)
    assert result.kv_pool_bytes == 16 * result.kv_pool_bytes_per_gpu
    # one GPU holds half the layers and one of the 8 KV heads of every token it serves
    per_token_gpu = capacity.kv_bytes_per_token(63, 1, 128, 2)
    assert result.max_concurrent_sequences == result.kv_pool_bytes_per_gpu // (per_token_gpu * 8192)


def test_decode_step_adds_the_stages_the_all_reduces_and_the_hops() -> None:
    link = capacity.Interconnect()
    weights = capacity.weight_bytes(LLAMA_405B.params, "bf16")
    flat = capacity.decode_step_seconds(
        LLAMA_405B, weights, 3350, capacity.Parallelism(tensor=16), link
    )
    piped = capacity.decode_step_seconds(
        LLAMA_405B, weights, 3350, capacity.Parallelism(tensor=8, pipeline=2), link
    )
    streaming = weights / (8 * 3350 * GB)  # two stages of W/16, one after the other
    allreduce = capacity.allreduce_seconds_per_token(
        LLAMA_405B, capacity.Parallelism(tensor=8, pipeline=2), link
    )
    hops = capacity.pipeline_hop_seconds(
        LLAMA_405B, capacity.Parallelism(tensor=8, pipeline=2), link
    )
    assert piped == pytest.approx(streaming + allreduce + hops)
    assert 2 * 126 * link.intra_node_latency_s < allreduce < 2 * 126 * 2 * link.intra_node_latency_s
    assert hops > link.inter_node_latency_s
    # a pipeline's stages take turns for one token: the bandwidth of 16 GPUs is not reached
    assert piped > flat - capacity.allreduce_seconds_per_token(
        LLAMA_405B, capacity.Parallelism(tensor=16), link
    )
    assert capacity.allreduce_seconds_per_token(LLAMA_405B, capacity.Parallelism(), link) == 0


def test_expert_parallelism_spreads_the_experts_over_every_rank() -> None:
    moe = capacity.ModelShape(
        num_layers=61, num_kv_heads=128, head_dim=128, params=671e9, expert_fraction=0.95
    )
    weights = capacity.weight_bytes(moe.params, "fp8")
    replicated = capacity.weight_bytes_per_gpu(weights, moe, capacity.Parallelism(data=16))
    wide = capacity.weight_bytes_per_gpu(weights, moe, capacity.Parallelism(data=16, expert=True))
    assert replicated == pytest.approx(weights)
    assert wide == pytest.approx(weights * 0.05 + weights * 0.95 / 16)


def test_shapes_fill_whole_nodes_with_tensor_parallelism_inside_a_node() -> None:
    found = capacity.shapes(gpus_per_node=8, max_nodes=2)
    assert all(p.gpus in (8, 16) and p.tensor <= 8 for p in found)
    assert capacity.Parallelism(tensor=8, pipeline=2) in found
    rows = dict(capacity.compare_shapes(LLAMA_405B, H100, capacity.Workload(8192), found))
    assert isinstance(rows[capacity.Parallelism(tensor=8)], str)  # one node: no fit
    assert isinstance(rows[capacity.Parallelism(tensor=8, pipeline=2)], capacity.Plan)
