"""The simulator's hardware profiles: derived from datasheets by one formula, and slowable."""

from __future__ import annotations

import pytest
from kubellm.engine import sim_profiles
from kubellm.engine.cli import sim_profile

from kubellm import capacity

H100 = sim_profiles.get("llama-3.1-8b-h100")
A100 = sim_profiles.get("llama-3.1-8b-a100")
L4 = sim_profiles.get("llama-3.1-8b-l4")
H100X4_70B = sim_profiles.get("llama-3.1-70b-4xh100")
H100X16_405B = sim_profiles.get("llama-3.1-405b-2x8xh100")
DEEPSEEK_RANK = sim_profiles.get("deepseek-v3-dp16-ep-2x8xh100")


def test_the_formula_gives_the_hand_derived_h100_profile_within_five_percent() -> None:
    derived = sim_profiles.derived(
        "check", "llama-3.1-8b", gpus=1, gpu_gib=80, bandwidth_gbps=3350, bf16_tflops=989,
        source="",
    )  # fmt: skip
    assert derived.num_blocks == H100.num_blocks
    for field in ("step_base_s", "prefill_token_s", "decode_token_s"):
        assert getattr(derived, field) == pytest.approx(getattr(H100, field), rel=0.05), field


# (profile, step base s, prefill s/token, decode s/token, KV blocks of 16 tokens), by hand
# from the datasheets in the profiles' comments.
TABLE = [
    (A100, 16.06e9 / (0.7 * 2039e9), 2 * 8.03e9 / (0.5 * 312e12), 262e6 / 2039e9, 29205),
    (L4, 16.06e9 / (0.7 * 300e9), 2 * 8.03e9 / (0.5 * 121e12), 262e6 / 300e9, 3400),
    (H100X4_70B, 35.3e9 / (0.7 * 3350e9) + 160 * 10e-6,
     2 * 70.6e9 / (4 * 0.5 * 989e12 * 0.85), 655e6 / 4 / 3350e9, 32068),
    (H100X16_405B, 2 * 50.7e9 / (0.7 * 3350e9) + 252 * 10e-6 + 15e-6,
     2 * 405.9e9 / (8 * 0.5 * 989e12 * 0.85), 2000 * 516096 / 8 / 3350e9,
     (16 * 72 * 2**30 - 811.8e9) // (516096 * 16)),
    # one DP rank of DeepSeek-V3 at DP 16 x EP 16: 17.1 B shared + 653.9 B / 16 routed in FP8
    (DEEPSEEK_RANK, 58.0e9 / (0.7 * 3350e9) + 58 * 487e-6 / 2, 2 * 37e9 / (0.5 * 1979e12),
     2000 * 61 * 576 * 2 / 3350e9, (72 * 2**30 - 58.0e9) // (61 * 576 * 2 * 16)),
]  # fmt: skip


@pytest.mark.parametrize(("profile", "base", "prefill", "decode", "blocks"), TABLE,
                         ids=[row[0].name for row in TABLE])  # fmt: skip
def test_profiles_follow_their_datasheets(
    profile: sim_profiles.Profile, base: float, prefill: float, decode: float, blocks: int
) -> None:
    assert profile.step_base_s == pytest.approx(base, rel=0.02)
    assert profile.prefill_token_s == pytest.approx(prefill, rel=0.02)
    assert profile.decode_token_s == pytest.approx(decode, rel=0.02)
    assert profile.num_blocks == pytest.approx(blocks, rel=0.01)
    assert "datasheet" in profile.source


def test_the_l4_pool_is_what_24_gib_leaves_after_the_8b_weights() -> None:
    weights = capacity.weight_bytes(capacity.known_model("llama-3.1-8b").params, "bf16")
    pool = capacity.kv_pool_bytes(24 * capacity.GIB, 0.9, weights)
    assert L4.num_blocks == pool // (128 * 1024 * 16)
    assert L4.num_blocks * 16 // 4096 == 13  # 4,096-token requests at once, as the comment says


def test_older_cards_are_slower_in_the_order_of_their_datasheets() -> None:
    def step(p: sim_profiles.Profile) -> float:
        return p.step_seconds(prefill_tokens=512, decode_tokens=32)

    assert step(H100) < step(A100) < step(L4)
    assert step(H100) < step(H100X4_70B)  # 70B on 4 cards: more weights per card than 8B on 1


@pytest.mark.parametrize("factor", [1.5, 2.0, 0.5])
def test_slowed_multiplies_every_step_cost(factor: float) -> None:
    slow = A100.slowed(factor)
    for prefill, decode in [(0, 1), (2048, 0), (100, 64)]:
        assert slow.step_seconds(prefill, decode) == pytest.approx(
            factor * A100.step_seconds(prefill, decode)
        )
    assert slow.name == f"llama-3.1-8b-a100x{factor:g}"
    assert slow.num_blocks == A100.num_blocks


def test_slowed_by_one_is_the_same_profile_and_bad_factors_name_the_flag() -> None:
    assert H100.slowed(1.0) is H100
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="--slowdown"):
            H100.slowed(bad)


def test_sim_profile_by_name_without_a_spec() -> None:
    assert sim_profile("llama-3.1-70b-4xh100", None)[0] == H100X4_70B
