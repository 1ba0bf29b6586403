"""`kubellm plan --trace --compare-shapes`: the candidate shapes, their simulated replicas
(the named profiles' formula) and the choice by goodput per GPU-hour."""

from __future__ import annotations

import pytest
from kubellm.engine import sim_profiles

from kubellm import api, capacity
from kubellm.simulation import shapes

LLAMA_405B = capacity.known_model("llama-3.1-405b")
H100 = {"gpu_gib": 80, "bandwidth_gbps": 3350, "bf16_tflops": 989}


def test_candidates_are_replicas_inside_a_node_then_whole_nodes() -> None:
    got = [(p.tensor, p.pipeline) for p in shapes.candidates(8, 2)]
    assert got == [(1, 1), (2, 1), (4, 1), (1, 8), (2, 4), (4, 2), (8, 1),
                   (1, 16), (2, 8), (4, 4), (8, 2)]  # fmt: skip


def test_a_shapes_replica_is_the_named_profiles_formula() -> None:
    derived = sim_profiles.for_shape(LLAMA_405B, 8, 2, **H100)
    named = sim_profiles.get("llama-3.1-405b-2x8xh100")
    for field in ("num_blocks", "step_base_s", "prefill_token_s", "decode_token_s"):
        assert getattr(derived, field) == getattr(named, field), field
    with pytest.raises(capacity.CapacityError):
        sim_profiles.for_shape(LLAMA_405B, 8, 1, **H100)  # 812 GB on 8 x 80 GiB


def test_shapes_that_do_not_fit_say_why_and_are_never_chosen() -> None:
    slo = api.SLO(ttft_seconds=3, itl_seconds=0.1)
    one_node = [capacity.Parallelism(8, 1), capacity.Parallelism(1, 200)]
    rows = shapes.compare(LLAMA_405B, [(1000, 100)], slo, one_node, gpu_gib=80,
                          bandwidth_gbps=3350, tflops=989)  # fmt: skip
    assert [r.why for r in rows] == ["weights do not fit", "more stages than layers"]
    assert shapes.best(rows) is None
    assert "no shape meets the SLO" in shapes.text(rows, "h", 8)


def test_the_best_shape_serves_the_most_per_gpu_hour_and_ties_go_to_fewer_gpus() -> None:
    row = shapes.ShapeRow
    rows = [row(4, 1, 4, 2.0, 16.0), row(8, 1, 8, 4.0, 9.0), row(8, 2, 16, 9.0, 40.0),
            row(2, 1, 2, None, why="x")]  # fmt: skip
    assert shapes.best(rows) == rows[2]  # 2,025 requests per GPU-hour
    assert shapes.best(rows[:2]) == rows[0]  # 1,800 each: the smaller replica
