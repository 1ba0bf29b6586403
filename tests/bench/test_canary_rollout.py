"""The canary rollout end to end on the local fleet (bench/canary_rollout.py): `kubellm up
--engine sim --watch` under a steady, bounded load. A good revision goes through both steps
and ends as the only one; a revision with 3x step time is rolled back within its first
analysis window, the canary answering fewer than weight x one window's requests; no request
fails; the stable revision's prefix-cache hit rate stays within 5 points. About a minute."""

from __future__ import annotations

from bench import canary_rollout


def test_good_revision_promoted_bad_one_rolled_back_hit_rate_kept() -> None:
    figures = canary_rollout.run()
    tail = figures.pop("fleet_log_tail")
    print(figures)  # the figures, for the log (pytest -s)
    good, bad, hits = figures["good"], figures["bad"], figures["hit_rate"]
    assert good["promoted"] and good["steps_passed"] == 2, tail
    assert good["failed_requests"] == 0, tail
    assert bad["step"] == 1, tail  # rolled back within its first window
    assert bad["window_open_to_rollback_s"] < bad["pause_s"], tail
    assert bad["reason"] in ("CanaryTTFTRegression", "CanaryITLRegression"), tail
    assert 0 < bad["canary_requests"] < bad["bound_weight_x_window_requests"], tail
    assert bad["failed_requests"] == 0 and figures["total_failed"] == 0, tail
    assert abs(hits["delta_points"]) <= canary_rollout.HIT_POINTS, tail
