"""The launcher's pure mapping (spec -> vLLM command line), one row per engine field."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubellm.engine import launcher

from kubellm import api
from kubellm.sources import HF_CACHE_DIR
from tests.fixtures.schema import leaf_fields


def _target(engine: dict[str, Any] | None = None, **spec: Any) -> launcher.EngineTarget:
    document = {"model": {"source": "hf://meta-llama/Llama-3.1-8B", "servedName": "llama"}}
    document.update(spec)
    if engine is not None:
        document["engine"] = engine
    return launcher.parse_target(document)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# (engine fields, flag, expected value; None: flag absent; "" : bare flag present)
TABLE = [
    ({}, "--dtype", "auto"),
    ({"dtype": "bfloat16"}, "--dtype", "bfloat16"),
    ({}, "--quantization", None),
    ({"quantization": "awq"}, "--quantization", "awq"),
    ({}, "--kv-cache-dtype", "auto"),
    ({"kvCacheDtype": "fp8"}, "--kv-cache-dtype", "fp8"),
    ({}, "--max-model-len", None),
    ({"maxModelLen": 8192}, "--max-model-len", "8192"),
    ({}, "--max-num-seqs", None),
    ({"maxNumSeqs": 64}, "--max-num-seqs", "64"),
    ({}, "--gpu-memory-utilization", "0.9"),
    ({"gpuMemoryUtilization": 0.85}, "--gpu-memory-utilization", "0.85"),
    ({}, "--tensor-parallel-size", "1"),
    ({"tensorParallelSize": 4}, "--tensor-parallel-size", "4"),
    ({}, "--pipeline-parallel-size", None),
    ({"pipelineParallelSize": 2}, "--pipeline-parallel-size", "2"),
    ({}, "--data-parallel-size", None),
    ({"dataParallelSize": 2}, "--data-parallel-size", "2"),
    ({}, "--enable-expert-parallel", None),
    ({"expertParallel": True}, "--enable-expert-parallel", ""),
    ({}, "--enable-prefix-caching", ""),
    ({"prefixCaching": False}, "--no-enable-prefix-caching", ""),
    ({}, "--enable-chunked-prefill", ""),
    ({}, "--max-num-batched-tokens", "2048"),
    ({"chunkedPrefill": {"maxNumBatchedTokens": 512}}, "--max-num-batched-tokens", "512"),
    ({"chunkedPrefill": {"enabled": False, "maxNumBatchedTokens": 4096}},
     "--no-enable-chunked-prefill", ""),
    ({}, "--block-size", None),
    ({"blockSize": 32}, "--block-size", "32"),
    ({}, "--port", "8000"),
    ({"port": 9000}, "--port", "9000"),
    ({}, "--speculative-config", None),
    ({"speculative": {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 3}},
     "--speculative-config",
     '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'),
    ({"speculative": {"method": "eagle", "model": "org/eagle-head"}}, "--speculative-config",
     '{"method": "eagle", "model": "org/eagle-head", "num_speculative_tokens": 3}'),
    ({}, "--enable-lora", None),
    ({"maxLoras": 3}, "--enable-lora", ""),
    ({"maxLoras": 3}, "--max-loras", "3"),
    ({"maxLoras": 2, "maxLoraRank": 64}, "--max-lora-rank", "64"),
    ({"maxLoras": 2}, "--max-lora-rank", None),
    ({}, "--kv-offloading-size", None),
    ({"kvOffload": {"hostGiB": 96}}, "--kv-offloading-size", "96"),
    ({"kvOffload": {"hostGiB": 96}}, "--kv-offloading-backend", "native"),
    ({"kvOffload": {"hostGiB": 8}}, "--kv-transfer-config", None),
    ({"kvOffload": {"hostGiB": 8, "disk": {"sizeGiB": 100, "claimName": "nvme"}}},
     "--kv-transfer-config",
     '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
     '{"spec_name":"TieringOffloadingSpec","secondary_tiers":[{"type":"fs",'
     '"root_dir":"/kv-offload"}]}}'),
]  # fmt: skip
# Engine fields with no vLLM flag, and where their behaviour is tested instead.
NOT_FLAGS = {
    "image": "the pod's image: the operator's builders (tests/operator/test_builders.py)",
    "extraArgs": "passed last, unchanged: test_extra_args_come_last_unchanged",
}


def _set_fields(fields: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, value in fields.items():
        path = f"{prefix}{key}"
        out |= _set_fields(value, f"{path}.") if isinstance(value, dict) else {path}
    return out


def test_the_table_has_a_row_for_every_engine_field() -> None:
    covered = set().union(*(_set_fields(engine) for engine, _, _ in TABLE)) | set(NOT_FLAGS)
    missing = leaf_fields(api.EngineSpec) - covered
    assert not missing, f"engine fields with no row in TABLE (or NOT_FLAGS): {sorted(missing)}"


@pytest.mark.parametrize(("engine", "flag", "expected"), TABLE)
def test_every_engine_field_maps_to_its_vllm_flag(
    engine: dict[str, Any], flag: str, expected: str | None
) -> None:
    shape = ("tensorParallelSize", "pipelineParallelSize", "dataParallelSize")
    gpus = math.prod(engine.get(size, 1) for size in shape)
    resources = {"gpu": {"count": gpus}} if gpus > 1 else {}
    argv = launcher.build_command(_target(engine, resources=resources), environ={}).argv
    if expected is None:
        assert flag not in argv
    elif expected == "":
        assert flag in argv
    else:
        assert _flag(argv, flag) == expected
    assert argv.count("--enable-prefix-caching") + argv.count("--no-enable-prefix-caching") == 1


def test_command_runs_vllms_openai_server_with_model_name_host_and_port() -> None:
    plan = launcher.build_command(_target(), port=8123, host="127.0.0.1", python="py", environ={})
    assert plan.argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(plan.argv, "--model") == "meta-llama/Llama-3.1-8B"
    assert _flag(plan.argv, "--served-model-name") == "llama"
    assert _flag(plan.argv, "--host") == "127.0.0.1"
    assert _flag(plan.argv, "--port") == "8123"


def test_extra_args_come_last_unchanged() -> None:
    extra = ["--enforce-eager", "--max-logprobs", "5"]
    argv = launcher.build_command(_target({"extraArgs": extra}), environ={}).argv
    assert argv[-3:] == extra


def test_hf_source_uses_the_cache_on_the_model_volume_and_the_revision() -> None:
    doc = {"model": {"source": "hf://Qwen/Qwen2.5-7B@abc123", "servedName": "q"}}
    plan = launcher.build_command(launcher.parse_target(doc), environ={})
    assert plan.model == "Qwen/Qwen2.5-7B"
    assert _flag(plan.argv, "--revision") == "abc123"
    assert _flag(plan.argv, "--download-dir") == HF_CACHE_DIR
    assert plan.env["HF_HUB_CACHE"] == HF_CACHE_DIR


def test_hf_offline_mode_uses_the_cache_and_fails_at_once_when_the_model_is_absent(
    tmp_path: Path,
) -> None:
    source = "hf://meta-llama/Llama-3.1-8B"
    offline = {"HF_HUB_OFFLINE": "1"}
    with pytest.raises(launcher.LaunchError, match="HF_HUB_OFFLINE is set"):
        launcher.resolve_model(source, environ=offline, hf_cache_dir=str(tmp_path))
    (tmp_path / "models--meta-llama--Llama-3.1-8B").mkdir()
    model, _, env = launcher.resolve_model(source, environ=offline, hf_cache_dir=str(tmp_path))
    assert model == "meta-llama/Llama-3.1-8B"
    assert "HF_HUB_OFFLINE" not in env  # inherited from the pod, not overridden


def test_pvc_source_resolves_under_the_model_root(tmp_path: Path) -> None:
    (tmp_path / "models" / "llama").mkdir(parents=True)
    doc = {"model": {"source": "pvc://weights/models/llama"}}
    plan = launcher.build_command(launcher.parse_target(doc), model_root=str(tmp_path), environ={})
    assert plan.model == str(tmp_path / "models" / "llama")
    assert _flag(plan.argv, "--served-model-name") == "llama"


def test_relative_file_source_resolves_against_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / ".kubellm" / "models" / "tiny").mkdir(parents=True)
    doc = {"model": {"source": "file://.kubellm/models/tiny", "servedName": "tiny"}}
    plan = launcher.build_command(launcher.parse_target(doc), cwd=tmp_path, environ={})
    assert plan.model == str(tmp_path / ".kubellm" / "models" / "tiny")


@pytest.mark.parametrize("source", ["file:///nonexistent/model", "pvc://claim/missing/path"])
def test_missing_local_model_fails_at_once_naming_the_path(source: str, tmp_path: Path) -> None:
    target = launcher.parse_target({"model": {"source": source, "servedName": "x"}})
    with pytest.raises(launcher.LaunchError, match=r"spec.model.source .* does not exist"):
        launcher.build_command(target, model_root=str(tmp_path))


def test_s3_source_is_refused_with_a_reason() -> None:
    target = launcher.parse_target({"model": {"source": "s3://bucket/m", "servedName": "x"}})
    with pytest.raises(launcher.LaunchError, match="s3://"):
        launcher.build_command(target)


def test_cpu_engines_get_a_small_kv_space_unless_the_environment_sets_one() -> None:
    target = _target(resources={"gpu": {"count": 0}})
    assert launcher.build_command(target, environ={}).env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    env = launcher.build_command(target, environ={"VLLM_CPU_KVCACHE_SPACE": "4"}).env
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert "VLLM_CPU_KVCACHE_SPACE" not in launcher.build_command(_target(), environ={}).env


def test_cpu_engines_refuse_a_block_size_vllm_cpu_cannot_use() -> None:
    target = _target({"blockSize": 16}, resources={"gpu": {"count": 0}})
    with pytest.raises(launcher.LaunchError, match=r"spec.engine.blockSize 16.*multiple of 32"):
        launcher.build_command(target, environ={})
    assert launcher.build_command(_target({"blockSize": 16}), environ={})  # GPUs take 16


def test_spec_file_may_hold_a_whole_deployment_in_json(tmp_path: Path) -> None:
    deployment = {
        "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": "chat"}, "spec": {"model": {"source": "hf://org/name"}},
    }  # fmt: skip
    path = tmp_path / "llmdeployment.json"
    path.write_text(json.dumps(deployment))
    target = launcher.load_target(path)
    assert target.served_name == "chat"  # defaults to metadata.name


def test_spec_file_may_hold_only_the_spec_in_yaml(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("model:\n  source: hf://org/name\n  servedName: s\nengine:\n  maxNumSeqs: 8\n")
    target = launcher.load_target(path)
    assert (target.served_name, target.spec.engine.max_num_seqs) == ("s", 8)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("model:\n  source: ftp://x\n", "spec.model.source"),
        ("model:\n  source: hf://o/n\nengine:\n  maxNumSeqs: zero\n", "maxNumSeqs"),
        ("engine: {}\n", "spec.model"),
    ],
)
def test_bad_spec_files_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(launcher.LaunchError, match=field):
        launcher.load_target(path)


def test_unreadable_spec_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(launcher.LaunchError, match=r"nope\.json"):
        launcher.load_target(tmp_path / "nope.json")


def test_torchcodec_shim_goes_first_on_pythonpath_and_makes_the_import_fail(
    tmp_path: Path,
) -> None:
    shim = launcher.write_torchcodec_shim(tmp_path)
    plan = launcher.with_torchcodec_shim(launcher.LaunchPlan(["x"]), shim, {"PYTHONPATH": "/a"})
    assert plan.env["PYTHONPATH"].split(":") == [shim, "/a"]
    probe = "try:\n import torchcodec\nexcept ImportError:\n print('absent')"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **plan.env},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.stdout.strip() == "absent"


def test_run_exits_non_zero_with_the_reason_when_vllm_fails_to_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = "import sys; print('loading'); print('ValueError: bad block size'); sys.exit(3)"
    plan = launcher.LaunchPlan([sys.executable, "-c", script])
    status = launcher.run(plan, health_url="http://127.0.0.1:9/health", log=sys.stdout)
    assert status == 3
    assert "vLLM failed to start (status 3): ValueError: bad block size" in capsys.readouterr().out


def test_sigterm_is_forwarded_to_vllm_and_the_launcher_exits_cleanly(tmp_path: Path) -> None:
    from tests.fixtures.engines import wait_until

    marker, got = tmp_path / "armed", tmp_path / "got"
    child = (
        "import signal, sys, pathlib, threading\n"
        f"def on_term(*_):\n    pathlib.Path({str(got)!r}).write_text('TERM'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        f"pathlib.Path({str(marker)!r}).write_text('1')\n"
        "threading.Event().wait(60)\n"
    )
    driver = (
        "import sys\nfrom kubellm.engine import launcher\n"
        f"plan = launcher.LaunchPlan([sys.executable, '-c', {child!r}])\n"
        "sys.exit(launcher.run(plan, health_url='http://127.0.0.1:9/health'))\n"
    )
    process = subprocess.Popen([sys.executable, "-c", driver], stderr=subprocess.PIPE, text=True)
    try:
        wait_until(marker.exists, 60, "the fake vLLM to install its SIGTERM handler")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert got.read_text() == "TERM"
    assert "vLLM stopped" in process.stderr.read()
