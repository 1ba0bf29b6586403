"""bench/gateway/dp_rank_routing.py: the leader-only contender is vLLM's internal data-parallel
balancer, and ranks as endpoints let prefix routing keep a prefix on one rank."""

from __future__ import annotations

from bench.gateway import dp_rank_routing as bench
from bench.gateway._slo.fleet import Fleet
from kubellm import api


def leader(ranks: int = 3) -> bench.LeaderOnly:
    profiles = [bench.sim_profiles.get(bench.PROFILE)] * ranks
    return bench.LeaderOnly(profiles, "prefix-aware", bench.SLO)


def test_the_leaders_balancer_scores_as_vllms_and_rotates_its_scan() -> None:
    fleet = leader()
    # (running, waiting, KV use): rank 1 has the fewest running + waiting
    for r, scraped in zip(fleet.replicas, [(5, 0, 0.1), (2, 1, 0.9), (4, 0, 0.2)], strict=True):
        r.scraped = scraped
    # rank 1: 2 + 1 + 1 x 6 x 0.4 = 5.4 against 5 and 4: rank 2
    assert fleet.choose(None)[0] == 2  # type: ignore[arg-type]
    fleet.outstanding[2] = 9  # its own in-flight count floors the snapshot: 9 against 5
    assert fleet.choose(None)[0] == 0  # type: ignore[arg-type]
    for r in fleet.replicas:
        r.scraped = (0, 0, 0.0)
    fleet.outstanding = [0, 0, 0]
    # equal scores: the first from a scan start that moved on by one at each decision
    assert [fleet.choose(None)[0] for _ in range(3)] == [2, 0, 1]  # type: ignore[arg-type]


def test_ranks_as_endpoints_hit_more_of_the_shared_prefixes_than_the_leader_only() -> None:
    jobs = bench.shared_workload(rate=8, seconds=20, seed=3)
    hit = {}
    for mode, cls in (("ranks", Fleet), ("leader", bench.LeaderOnly)):
        profiles = [bench.sim_profiles.get(bench.PROFILE)] * 4
        fleet = cls(profiles, api.Routing().policy, bench.SLO, seed=3)
        hit[mode] = bench.summarize(fleet, fleet.run(jobs).outcomes)["hit"]
    assert hit["ranks"] > hit["leader"]
