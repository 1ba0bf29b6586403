"""spec.engine.extraArgs may not set again what the launcher derives from the spec, in any
spelling vLLM's parser accepts (underscores for dashes, unambiguous prefixes, -tp), and
`kubellm validate` refuses what `kubellm render` refuses. vLLM's own parser checks the list."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubellm.operator import builders

from kubellm import api, contracts
from tests.fixtures.engines import REPO_ROOT

REFUSED = [
    ["--served_model_name", "other"],
    ["--served-model", "other"],
    ["--served-model-name=other"],
    ["--hos", "0.0.0.0"],
    ["--host=0.0.0.0"],
    ["--tensor_parallel_size=8"],
    ["--tensor-parallel", "8"],
    ["-tp", "2"],
    ["--port", "9"],
    ["--model", "other/weights"],
    ["-pp", "2"],
    ["--pipeline_parallel_size=2"],
    ["--data-parallel-size", "2"],
    ["--enable-expert-parallel"],
    ["--nnodes", "2"],
    ["--node-rank", "1"],
    ["--master-addr", "10.0.0.1"],
    ["--headless"],
    ["--distributed-executor-backend", "ray"],
]
ACCEPTED = [
    ["--enforce-eager"],
    ["--max-num-batched-tokens=512"],
    ["--model-impl", "vllm"],
    ["--seed", "1"],
    ["--disable_log_stats"],
]


@pytest.mark.parametrize("args", REFUSED, ids=" ".join)
def test_each_spelling_of_an_owned_argument_is_refused(args: list[str]) -> None:
    problem = api.extra_args_problem(args)
    assert problem is not None and problem.startswith("spec.engine.extraArgs: ")
    with pytest.raises(builders.SpecError) as error:  # the operator's refusal: the same
        builders.check(deployment(args))
    assert error.value.reason == "InvalidEngineArguments"


@pytest.mark.parametrize("args", ACCEPTED, ids=" ".join)
def test_other_arguments_pass(args: list[str]) -> None:
    assert api.extra_args_problem(args) is None
    builders.check(deployment(args))


def deployment(extra_args: list[str]) -> api.LLMDeployment:
    return api.LLMDeployment.model_validate(document(extra_args))


def document(extra_args: list[str]) -> dict:
    return {
        "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": "m"},
        "spec": {"model": {"source": "hf://org/m"}, "engine": {"extraArgs": extra_args}},
    }  # fmt: skip


def manifest(tmp_path: Path, extra_args: list[str]) -> Path:
    path = tmp_path / "llmd.yaml"
    path.write_text(yaml.safe_dump(document(extra_args)))
    return path


@pytest.mark.parametrize("command", ["validate", "render"])
def test_validate_refuses_what_render_refuses(tmp_path: Path, command: str) -> None:
    path = manifest(tmp_path, ["--served_model_name", "other"])
    done = subprocess.run(
        [sys.executable, "-m", "kubellm.cli", command, "-f", str(path)],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout
    assert "extraArgs" in done.stderr + done.stdout


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM's own parser is the reference"
)
OWNED_DESTS = {
    "served_model_name": None, "host": None, "port": 8000, "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1, "data_parallel_size": 1, "enable_expert_parallel": False,
    "nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": 29501,
    "headless": False, "distributed_executor_backend": None,
}  # fmt: skip


@pytest.fixture(scope="module")
def vllm_parser(tmp_path_factory: pytest.TempPathFactory):
    from kubellm.engine import launcher

    if launcher.torchcodec_broken():
        sys.path.insert(0, launcher.write_torchcodec_shim(tmp_path_factory.mktemp("shim")))
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def vllm_sets(parser, args: list[str]) -> set[str]:
    """The owned options `args` change as vLLM parses them (--model aside: compared with
    the default model)."""
    values = vars(parser.parse_args(["--model", "base/model", *args]))
    changed = {k for k, default in OWNED_DESTS.items() if values.get(k) != default}
    if values.get("model") != "base/model":
        changed.add("model")
    return changed


@needs_vllm
def test_vllms_parser_agrees_with_the_refusals(vllm_parser) -> None:
    for args in REFUSED:
        assert vllm_sets(vllm_parser, args), f"vLLM does not read {args} as an owned option"
    for args in ACCEPTED:
        assert not vllm_sets(vllm_parser, args), f"vLLM reads {args} as an owned option"


# Replica shapes (engine, nodes, GPUs per pod): 405B on 2x8 (TP 8, PP 2), a DeepSeek-class
# MoE served wide (DP 2 x TP 8 with expert parallelism) on 2x8, TP 4 x PP 4 on 4x4, and the
# MoE as 16 data-parallel attention ranks (TP 1) on 2x8 and 8 on one node of 8.
SHAPES = {
    "tp8-pp2": ({"tensorParallelSize": 8, "pipelineParallelSize": 2}, 2, 8),
    "dp2-tp8-ep": ({"tensorParallelSize": 8, "dataParallelSize": 2, "expertParallel": True}, 2, 8),
    "tp4-pp4": ({"tensorParallelSize": 4, "pipelineParallelSize": 4}, 4, 4),
    "dp16-ep": ({"tensorParallelSize": 1, "dataParallelSize": 16, "expertParallel": True}, 2, 8),
    "dp8-ep": ({"tensorParallelSize": 1, "dataParallelSize": 8, "expertParallel": True}, 1, 8),
}


@needs_vllm
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_vllms_parser_reads_each_nodes_command_line_as_meant(vllm_parser, shape: str) -> None:
    from kubellm.engine import launcher
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine, nodes, gpus = SHAPES[shape]
    target = launcher.parse_target({
        "model": {"source": "hf://org/big", "servedName": "big"}, "engine": engine,
        "resources": {"nodes": nodes, "gpu": {"count": gpus}},
    })  # fmt: skip
    local = contracts.dp_ranks_per_pod(target.spec)  # DP ranks each pod serves as endpoints
    for rank in range(nodes):
        environ = {"LWS_LEADER_ADDRESS": "big-lws-0.big-lws", "LWS_WORKER_INDEX": str(rank)}
        argv = launcher.build_command(target, environ=environ).argv
        headless = rank > 0 and not local
        serve = headless or local > 1
        assert argv[2] == (launcher.VLLM_SERVE_MODULE if serve else launcher.VLLM_MODULE)
        parsed = vllm_parser.parse_args(argv[3:])
        args = AsyncEngineArgs.from_cli_args(parsed)
        assert parsed.headless is headless
        assert_rank_endpoints(parsed, target.spec, first_rank=rank * local)
        if nodes == 1:
            assert args.nnodes == 1 and args.distributed_executor_backend is None
            continue
        assert (args.nnodes, args.node_rank) == (nodes, rank)
        assert (args.master_addr, args.distributed_executor_backend) == ("big-lws-0.big-lws", "mp")
        assert args.tensor_parallel_size == engine["tensorParallelSize"]
        assert args.pipeline_parallel_size == engine.get("pipelineParallelSize", 1)
        assert args.data_parallel_size == engine.get("dataParallelSize", 1)
        assert args.enable_expert_parallel is engine.get("expertParallel", False)
        world = args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size
        assert world == nodes * gpus and world % args.nnodes == 0  # vLLM's own launch check


def assert_rank_endpoints(parsed, spec, first_rank: int) -> None:
    """The API servers vLLM starts for this pod's command line are, rank by rank, on the
    ports the operator names (contracts.serving_ports), as data-parallel ranks first_rank,
    first_rank + 1, ...: vLLM's own supervisor arithmetic (multi-port external LB) or its
    single external-LB rank."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers import dp_supervisor

    ports = [port for _, port in contracts.serving_ports(spec)]
    local = contracts.dp_ranks_per_pod(spec)
    if local == 0:
        assert parsed.data_parallel_rank is None and ports == [parsed.port]
        assert not parsed.data_parallel_multi_port_external_lb
        return
    ServeSubcommand().validate(parsed)  # vLLM's own checks of the LB mode's flags
    if local == 1:
        assert (parsed.data_parallel_rank, parsed.port, ports) == (first_rank, ports[0], ports)
        return
    assert parsed.data_parallel_multi_port_external_lb
    children = [dp_supervisor._build_vllm_dp_server_args(parsed, i) for i in range(local)]
    assert [c.port for c in children] == ports
    assert [c.data_parallel_rank for c in children] == list(range(first_rank, first_rank + local))
    assert all(c.data_parallel_external_lb and c.data_parallel_size_local == 1 for c in children)
