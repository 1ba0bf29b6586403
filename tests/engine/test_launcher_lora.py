"""LoRA in the launcher: spec.adapters and the engine limits as vLLM's flags and environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubellm.engine import launcher

from kubellm import contracts, manifests


def _target(adapters: list[dict[str, Any]], engine: dict[str, Any] | None = None, **model: Any):
    document = {
        "model": {"source": "pvc://models/llama", "servedName": "llama", **model},
        "adapters": adapters,
        "engine": engine or {},
    }
    return launcher.parse_target(document)


def _plan(target: launcher.EngineTarget, root: Path, **kwargs: Any) -> launcher.LaunchPlan:
    """The plan with the model's claim mounted at `root` (the model itself present)."""
    (root / "llama").mkdir(exist_ok=True)
    return launcher.build_command(target, model_root=str(root), environ={}, **kwargs)


def _modules(argv: list[str]) -> list[dict[str, str]]:
    start = argv.index("--lora-modules") + 1
    out = []
    for item in argv[start:]:
        if item.startswith("--"):
            break
        out.append(json.loads(item))
    return out


# (adapter source, the path vLLM is given; the model is pvc://models/llama under ROOT)
SOURCES = [
    ("pvc://models/adapters/sql", "ROOT/adapters/sql"),  # on the model's own claim
    ("pvc://team-a/sql", "/adapters/team-a/sql"),  # another claim: under ADAPTER_ROOT
    ("hf://acme/sql-lora", "acme/sql-lora"),
    ("file:///srv/adapters/sql", "/srv/adapters/sql"),
]


@pytest.mark.parametrize(("source", "path"), SOURCES)
def test_each_adapter_source_becomes_a_lora_module(source: str, path: str, tmp_path: Path) -> None:
    plan = _plan(_target([{"name": "sql", "source": source}]), tmp_path)
    path = path.replace("ROOT", str(tmp_path))
    assert _modules(plan.argv) == [{"name": "sql", "path": path, "base_model_name": "llama"}]


def test_relative_file_adapters_resolve_against_the_working_directory(tmp_path: Path) -> None:
    target = _target([{"name": "a", "source": "file://adapters/a"}])
    plan = _plan(target, tmp_path, cwd=tmp_path)
    assert _modules(plan.argv)[0]["path"] == str(tmp_path / "adapters" / "a")


def test_adapters_turn_lora_on_with_default_slots_and_runtime_loading(tmp_path: Path) -> None:
    plan = _plan(
        _target([{"name": "a", "source": "hf://o/a"}, {"name": "b", "source": "hf://o/b"}]),
        tmp_path,
    )
    assert "--enable-lora" in plan.argv
    assert plan.argv[plan.argv.index("--max-loras") + 1] == str(contracts.DEFAULT_MAX_LORAS)
    assert [m["name"] for m in _modules(plan.argv)] == ["a", "b"]
    assert plan.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_no_adapters_and_no_max_loras_leave_lora_off(tmp_path: Path) -> None:
    plan = _plan(_target([]), tmp_path)
    assert not any("lora" in arg for arg in plan.argv)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plan.env


def test_max_loras_alone_enables_runtime_loading_without_modules(tmp_path: Path) -> None:
    plan = _plan(_target([], {"maxLoras": 2}), tmp_path)
    assert "--enable-lora" in plan.argv and "--lora-modules" not in plan.argv
    assert plan.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_extra_args_still_come_after_the_lora_flags(tmp_path: Path) -> None:
    target = _target([{"name": "a", "source": "hf://o/a"}], {"extraArgs": ["--seed", "1"]})
    assert _plan(target, tmp_path).argv[-2:] == ["--seed", "1"]


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("s3://bucket/a", "s3:// sources are not supported"),
        ("hf://acme/a@v2", "repository id only"),
    ],
)
def test_adapters_vllm_cannot_load_are_refused_naming_the_adapter(
    source: str, words: str, tmp_path: Path
) -> None:
    with pytest.raises(launcher.LaunchError, match=words) as refused:
        _plan(_target([{"name": "sql", "source": source}]), tmp_path)
    assert "spec.adapters sql" in str(refused.value)


PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
print(json.dumps({"enable_lora": args.enable_lora, "max_loras": args.max_loras,
                  "max_lora_rank": args.max_lora_rank,
                  "modules": [[m.name, m.path, m.base_model_name] for m in args.lora_modules]}))
"""


def test_flags_parse_with_the_installed_vllm(tmp_path: Path) -> None:
    """The argument names are vLLM's own: its server's parser accepts them as built (in a
    child process, with the launcher's torchcodec stand-in, as the launcher runs vLLM)."""
    pytest.importorskip("vllm")
    target = _target(
        [{"name": "a", "source": "file:///srv/a"}, {"name": "b", "source": "hf://o/b"}],
        {"maxLoras": 2, "maxLoraRank": 64},
    )
    argv = _plan(target, tmp_path).argv
    env = {**os.environ, "PYTHONPATH": launcher.write_torchcodec_shim(tmp_path / "shim")}
    out = subprocess.run(
        [sys.executable, "-c", PARSE, *argv[3:]],
        env=env, capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed == {
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 64,
        "modules": [["a", "/srv/a", "llama"], ["b", "o/b", "llama"]],
    }


def test_adapter_edits_keep_the_engine_identity_and_lora_on_changes_it() -> None:
    def deployment(spec: dict[str, Any]):
        return manifests.parse(
            {
                "apiVersion": "kubellm.io/v1alpha1",
                "kind": "LLMDeployment",
                "metadata": {"name": "llama"},
                "spec": {"model": {"source": "hf://o/m"}, **spec},
            }
        )

    one = deployment({"adapters": [{"name": "a", "source": "hf://o/a"}]})
    two = deployment({"adapters": [{"name": "a", "source": "hf://o/a"},
                                   {"name": "b", "source": "hf://o/b"}]})  # fmt: skip
    none = deployment({})
    assert contracts.engine_spec_json(one) != contracts.engine_spec_json(two)
    assert contracts.engine_identity_json(one) == contracts.engine_identity_json(two)
    assert contracts.engine_identity_json(none) != contracts.engine_identity_json(one)
    # without LoRA the identity is the engine spec itself (no rollout on upgrade)
    assert contracts.engine_identity_json(none) == contracts.engine_spec_json(none)
