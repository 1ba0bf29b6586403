"""Local vLLM CPU replicas get their own cores (kubellm.fleet.cores): the assignment table,
and the fleet passing it to each replica's process."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from kubellm import manifests
from kubellm.fleet.cores import OMP_BIND_ENV, free_slot, omp_bind_env, omp_cores
from kubellm.fleet.processes import Supervisor
from kubellm.fleet.runtime import LocalRuntime
from tests.fixtures.engines import wait_until


@pytest.mark.parametrize(
    ("slot", "slots", "cpus", "cores"),
    [
        (0, 1, [0], [0]),  # one core: nothing else to give
        (3, 4, [0], [0]),
        (0, 1, [0, 1], [0]),  # alone: what vLLM's auto gives (the last core kept free)
        (0, 2, [0, 1], [0]),  # a stable replica and its canary on 2 cores: one each
        (1, 2, [0, 1], [1]),
        (2, 3, [0, 1], [0]),  # more replicas than cores: wrap around
        (0, 1, list(range(16)), list(range(15))),
        (0, 2, list(range(16)), list(range(7))),
        (1, 2, list(range(16)), list(range(7, 14))),
        (2, 3, list(range(16)), list(range(10, 15))),
        (1, 2, [2, 5, 7, 9], [5]),  # the allowed cores, not 0..n-1
        (4, 5, [0, 1, 2, 3], [0]),
    ],
)
def test_each_slot_gets_its_block_of_cores(
    slot: int, slots: int, cpus: list[int], cores: list[int]
) -> None:
    assert omp_cores(slot, slots, cpus) == cores


def test_bad_slots_are_refused() -> None:
    with pytest.raises(ValueError, match="no cores"):
        omp_cores(0, 1, [])
    with pytest.raises(ValueError, match="slot -1 of 1"):
        omp_cores(-1, 1, [0, 1])
    with pytest.raises(ValueError, match="slot 0 of 0"):
        omp_cores(0, 0, [0, 1])


def test_the_bind_string_and_a_bind_already_set() -> None:
    assert omp_bind_env(1, 2, list(range(16)), {}) == {OMP_BIND_ENV: "7,8,9,10,11,12,13"}
    assert omp_bind_env(1, 2, [0, 1], {OMP_BIND_ENV: "0-1"}) == {}  # the user's own wins
    assert omp_bind_env(1, 2, [0, 1], {OMP_BIND_ENV: ""}) == {OMP_BIND_ENV: "1"}


@pytest.mark.parametrize(
    ("taken", "slot"), [([], 0), ([0], 1), ([1], 0), ([0, 2], 1), ([0, 1, 2], 3)]
)
def test_free_slot_is_the_lowest_free(taken: list[int], slot: int) -> None:
    assert free_slot(taken) == slot


def _manifest(source: str, **spec: Any) -> Any:
    return manifests.parse({
        "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": "m"},
        "spec": {"model": {"source": source}, "replicas": 1,
                 "rollout": {"strategy": "Canary", "steps": [{"weight": 10}]}, **spec},
    })  # fmt: skip


def test_the_fleet_binds_a_stable_replica_and_its_canary_to_distinct_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kubellm up --engine vllm`: a CPU deployment's replica and its canary's start with
    their own VLLM_CPU_OMP_THREADS_BIND. The replicas run a stand-in that prints the
    variable (no vLLM started); the runtime's own command is what would run."""
    monkeypatch.delenv(OMP_BIND_ENV, raising=False)
    cpus = [0, 1, 2, 3, 4]  # as if the machine had 5 cores: (5 - 1) // 2 = 2 each
    monkeypatch.setattr("kubellm.fleet.cores.os.sched_getaffinity", lambda _pid: set(cpus))
    supervisor = Supervisor(tmp_path / "logs")
    runtime = LocalRuntime(supervisor, tmp_path / "run", engine="vllm")
    cpu = {"resources": {"gpu": {"count": 0}}}
    runtime.apply([_manifest("hf://org/m", **cpu)])
    assert "--spec" in supervisor.commands["m"](0, 8000)  # a real vLLM command line

    def prints_bind(_index: int, _port: int) -> list[str]:
        return [sys.executable, "-c", f"import os; print('bind=' + os.environ['{OMP_BIND_ENV}'])"]

    supervisor.commands["m"] = prints_bind
    runtime.apply([_manifest("hf://org/m-v2", **cpu)])  # a new revision: a canary beside
    canary = runtime.deployments["m"].canary_key
    assert canary in supervisor.envs
    supervisor.commands[canary] = prints_bind
    supervisor.set_replicas(canary, 1)

    async def start() -> None:
        await supervisor.reconcile()
        for replicas in supervisor.replicas.values():
            for replica in replicas:
                assert replica.process is not None
                await asyncio.wait_for(replica.process.wait(), 60)

    asyncio.run(start())
    logs = {name: supervisor.replicas[name][0].log_path for name in ("m", canary)}
    wait_until(lambda: all(p.exists() and "bind=" in p.read_text() for p in logs.values()), 60)
    binds = {name: p.read_text().split("bind=")[1].strip() for name, p in logs.items()}
    assert binds == {"m": "0,1", canary: "2,3"}

    # the simulator, a GPU deployment and a P/D pair keep their own (no slot)
    assert (
        LocalRuntime(supervisor, tmp_path, engine="sim").replica_env(_manifest("hf://o/m", **cpu))
        is None
    )
    assert runtime.replica_env(_manifest("hf://org/m")) is None
