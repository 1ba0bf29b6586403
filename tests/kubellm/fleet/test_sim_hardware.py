"""`kubellm up --engine sim` gives replicas different profiles and slowdowns."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from kubellm.engine import sim_profiles

from kubellm import api, capacity, manifests
from kubellm.fleet.processes import Replica, Supervisor
from kubellm.fleet.runtime import LocalRuntime
from kubellm.fleet.up import configure
from tests.fixtures.engines import wait_until
from tests.fixtures.fleets import write_manifest


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(["-f", "x.yaml", *argv])


def test_profiles_and_slowdowns_are_comma_lists_checked_at_parse() -> None:
    args = _parse("--sim-profile", "llama-3.1-8b-h100,llama-3.1-8b-a100",
                  "--sim-slowdown", "1,1.5")  # fmt: skip
    assert args.sim_profile == ("llama-3.1-8b-h100", "llama-3.1-8b-a100")
    assert args.sim_slowdown == (1.0, 1.5)
    for bad in (("--sim-profile", "h100,nope"), ("--sim-slowdown", "1,x"),
                ("--sim-slowdown", "1,0")):  # fmt: skip
        with pytest.raises(SystemExit):
            _parse(*bad)


@pytest.mark.parametrize(
    ("profiles", "slowdowns", "expected"),
    [
        (None, None, [[], [], []]),
        (("a",), None, [["--profile", "a"]] * 3),
        (("a", "b"), (1.0, 1.5), [["--profile", "a"], ["--profile", "b", "--slowdown", "1.5"],
                                  ["--profile", "a"]]),
        (None, (1.0, 1.0, 2.0), [[], [], ["--slowdown", "2"]]),
    ],
)  # fmt: skip
def test_replica_i_gets_item_i_mod_n(
    tmp_path: Path, profiles: Any, slowdowns: Any, expected: list[list[str]]
) -> None:
    runtime = LocalRuntime(Supervisor(tmp_path), tmp_path, engine="sim",
                           sim_profile=profiles, sim_slowdown=slowdowns)  # fmt: skip
    assert [runtime.sim_hardware(i) for i in range(3)] == expected


def test_a_sim_fleet_runs_each_replica_on_its_own_hardware(
    start_fleet: Any, tmp_path: Path
) -> None:
    spec = {"model": {"source": "hf://org/mixed", "servedName": "mixed"}, "replicas": 2}
    fleet = start_fleet(
        write_manifest(tmp_path / "mixed.yaml", "mixed", spec),
        extra=("--sim-profile", "llama-3.1-8b-h100,llama-3.1-8b-a100", "--sim-slowdown", "1,1.5"),
    )
    logs = [fleet.run_dir / "logs" / f"mixed-{i}.log" for i in range(2)]

    def banners() -> bool:
        return all(p.exists() and "profile " in p.read_text() for p in logs)

    wait_until(lambda: banners() or fleet.process.poll() is not None, 60, "both banners")
    assert banners(), fleet.output()
    assert "profile llama-3.1-8b-h100," in logs[0].read_text()
    assert "profile llama-3.1-8b-a100x1.5," in logs[1].read_text()
    fleet.stop()


def _ready(supervisor: Supervisor, key: str, count: int, tmp_path: Path) -> None:
    """Play the supervisor: `count` replicas of `key` run and pass /health."""
    supervisor.replicas[key] = [
        Replica(key, i, 41000 + i, [], tmp_path / f"{key}-{i}.log", state="ready")
        for i in range(count)
    ]


def _manifest(**spec: Any) -> api.LLMDeployment:
    return manifests.parse({
        "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": "m"},
        "spec": {"model": {"source": "hf://org/m"}, "replicas": 3, **spec},
    })  # fmt: skip


def test_each_sim_replica_carries_its_profiles_step_costs(tmp_path: Path) -> None:
    """The gateway's latency model starts each simulated replica from its own profile (in
    wall seconds: x --sim-time-scale), the same one `kubellm engine --backend sim` runs."""
    supervisor = Supervisor(tmp_path / "logs")
    runtime = LocalRuntime(supervisor, tmp_path, engine="sim", sim_time_scale=0.5,
                           sim_profile=("llama-3.1-8b-h100", "llama-3.1-8b-a100"),
                           sim_slowdown=(1.0, 1.0, 1.5))  # fmt: skip
    runtime.apply([_manifest(engine={"chunkedPrefill": {"maxNumBatchedTokens": 4096}})])
    _ready(supervisor, "m", 3, tmp_path)
    costs = [e.step_costs for e in runtime.gateway_targets()["m"].endpoints]
    h100, a100 = sim_profiles.get("llama-3.1-8b-h100"), sim_profiles.get("llama-3.1-8b-a100")
    for got, (profile, factor) in zip(costs, [(h100, 1.0), (a100, 1.0), (h100, 1.5)], strict=True):
        assert got is not None
        assert got.step_base_s == pytest.approx(profile.step_base_s * factor * 0.5)
        assert got.prefill_token_s == pytest.approx(profile.prefill_token_s * factor * 0.5)
        assert got.decode_token_s == pytest.approx(profile.decode_token_s * factor * 0.5)
        assert got.max_num_batched_tokens == 4096  # the spec's budget, as the simulator's
    # a CPU deployment without --sim-profile runs tiny-cpu
    runtime = LocalRuntime(supervisor, tmp_path, engine="sim")
    runtime.apply([_manifest(resources={"gpu": {"count": 0}})])
    _ready(supervisor, "m", 1, tmp_path)
    (cpu, *_) = [e.step_costs for e in runtime.gateway_targets()["m"].endpoints]
    assert cpu is not None and cpu.step_base_s == sim_profiles.get("tiny-cpu").step_base_s
    # a virtual clock (scale 0) has no wall-time figures
    runtime = LocalRuntime(supervisor, tmp_path, engine="sim", sim_time_scale=0)
    runtime.apply([_manifest()])
    _ready(supervisor, "m", 1, tmp_path)
    assert {e.step_costs for e in runtime.gateway_targets()["m"].endpoints} == {None}


def test_vllm_replicas_take_the_decode_bound_the_operator_would_write(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path / "logs")
    runtime = LocalRuntime(supervisor, tmp_path, engine="vllm")
    planned = _manifest(
        model={"source": "hf://org/m", "architecture": {
            "numLayers": 32, "numKVHeads": 32, "headDim": 128, "paramsBillions": 7}},
        engine={"maxModelLen": 4096},
        resources={"gpu": {"memoryGiB": 80, "bandwidthGBps": 2000}},
    )  # fmt: skip
    runtime.apply([planned])
    _ready(supervisor, "m", 3, tmp_path)
    target = runtime.gateway_targets()["m"]
    assert target.decode_tokens_per_second_bound == capacity.for_spec(planned.spec)[
        "decodeTokensPerSecondBound"
    ]  # fmt: skip
    assert {e.step_costs for e in target.endpoints} == {None}
    runtime.apply([_manifest()])  # no architecture: no bound
    assert runtime.gateway_targets()["m"].decode_tokens_per_second_bound is None
