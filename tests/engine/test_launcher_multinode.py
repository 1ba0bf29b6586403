"""A replica spanning nodes: the launcher's leader and worker command lines (vLLM's native
multi-node launch). That vLLM's own parser reads them as meant:
tests/kubellm/test_engine_args.py."""

from __future__ import annotations

from typing import Any

import pytest
from kubellm.engine import launcher

LWS_ENV = {"LWS_LEADER_ADDRESS": "m-lws-0.m-lws.llm", "LWS_WORKER_INDEX": "0"}


def target(engine: dict[str, Any], nodes: int, gpus: int) -> launcher.EngineTarget:
    return launcher.parse_target({
        "model": {"source": "hf://meta-llama/Llama-3.1-405B", "servedName": "llama"},
        "engine": engine,
        "resources": {"nodes": nodes, "gpu": {"count": gpus}},
    })  # fmt: skip


TP8_PP2 = target({"tensorParallelSize": 8, "pipelineParallelSize": 2}, nodes=2, gpus=8)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_leader_serves_the_api_with_the_group_s_launch_flags() -> None:
    plan = launcher.build_command(TP8_PP2, environ=LWS_ENV)
    assert plan.serves and launcher.VLLM_MODULE in plan.argv
    assert "--headless" not in plan.argv
    assert flag(plan.argv, "--nnodes") == "2" and flag(plan.argv, "--node-rank") == "0"
    assert flag(plan.argv, "--master-addr") == LWS_ENV["LWS_LEADER_ADDRESS"]
    assert flag(plan.argv, "--master-port") == str(launcher.MASTER_PORT)
    assert flag(plan.argv, "--distributed-executor-backend") == "mp"
    assert flag(plan.argv, "--tensor-parallel-size") == "8"
    assert flag(plan.argv, "--pipeline-parallel-size") == "2"


def test_a_worker_joins_headless_through_vllm_serve() -> None:
    plan = launcher.build_command(TP8_PP2, environ={**LWS_ENV, "LWS_WORKER_INDEX": "1"})
    assert not plan.serves
    assert plan.argv[1:3] == ["-m", launcher.VLLM_HEADLESS_MODULE]
    assert "--headless" in plan.argv and flag(plan.argv, "--node-rank") == "1"


def test_flags_override_the_environment() -> None:
    plan = launcher.build_command(TP8_PP2, environ={}, node_rank=1, master_addr="127.0.0.1")
    assert flag(plan.argv, "--master-addr") == "127.0.0.1" and "--headless" in plan.argv


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        ({}, "LWS_WORKER_INDEX"),
        ({"LWS_WORKER_INDEX": "1"}, "LWS_LEADER_ADDRESS"),
        ({**LWS_ENV, "LWS_WORKER_INDEX": "two"}, "not an integer"),
        ({**LWS_ENV, "LWS_WORKER_INDEX": "2"}, "outside 0-1"),
    ],
)
def test_a_pod_that_cannot_know_its_rank_fails_at_once_saying_why(
    environ: dict[str, str], words: str
) -> None:
    with pytest.raises(launcher.LaunchError, match=words):
        launcher.build_command(TP8_PP2, environ=environ)


def test_one_node_replicas_have_no_multi_node_flags() -> None:
    argv = launcher.build_command(
        target({"tensorParallelSize": 8}, nodes=1, gpus=8), environ=LWS_ENV
    ).argv
    for name in ("--nnodes", "--node-rank", "--master-addr", "--headless"):
        assert name not in argv


def test_data_parallel_ranks_inside_pods_make_every_pod_serve_its_ranks() -> None:
    wide = target({"tensorParallelSize": 1, "dataParallelSize": 16, "expertParallel": True},
                  nodes=2, gpus=8)  # fmt: skip
    worker = launcher.build_command(wide, environ={**LWS_ENV, "LWS_WORKER_INDEX": "1"})
    assert worker.serves and "--headless" not in worker.argv
    assert worker.argv[1:3] == ["-m", launcher.VLLM_SERVE_MODULE]  # vLLM's rank supervisor
    assert flag(worker.argv, "--data-parallel-size-local") == "8"
    assert "--data-parallel-multi-port-external-lb" in worker.argv
    one_rank_each = target({"tensorParallelSize": 8, "dataParallelSize": 2}, nodes=2, gpus=8)
    plan = launcher.build_command(one_rank_each, environ={**LWS_ENV, "LWS_WORKER_INDEX": "1"})
    assert plan.serves and flag(plan.argv, "--data-parallel-rank") == "1"
    assert plan.argv[2] == launcher.VLLM_MODULE
    behind_leader = target({"tensorParallelSize": 8, "pipelineParallelSize": 2,
                            "dataParallelSize": 2}, nodes=4, gpus=8)  # fmt: skip
    plan = launcher.build_command(behind_leader, environ={**LWS_ENV, "LWS_WORKER_INDEX": "1"})
    assert not plan.serves and "--headless" in plan.argv  # ranks span pods: internal LB
    assert "--data-parallel-rank" not in plan.argv
