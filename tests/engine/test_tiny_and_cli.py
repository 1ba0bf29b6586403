"""The tiny checkpoint and the `kubellm engine` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kubellm.engine import cli as engine_cli
from kubellm.engine import tiny

from tests.fixtures.engines import requires_engine_extra

REPO = Path(__file__).resolve().parents[2]


@requires_engine_extra
def test_tiny_checkpoint_is_deterministic_and_fits_vllms_cpu_backend(tmp_path: Path) -> None:
    first = tiny.build(tmp_path / "first", train_steps=5)
    again = tiny.build(tmp_path / "again", train_steps=5)
    assert tiny.fingerprint(first) == tiny.fingerprint(again)  # training included
    assert tiny.fingerprint(first) != tiny.fingerprint(tiny.build(tmp_path / "raw", train_steps=0))
    config = json.loads((again / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] >= 64  # CPU attention needs it


def test_tiny_tokenizer_round_trips_and_has_a_chat_template(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "The cache holds every block of the prefix."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode(text)) < len(text) / 2  # BPE merges learned from the corpus
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("assistant\n") and "hi" in chat


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kubellm.engine", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_the_trained_checkpoint_continues_its_corpus(tiny_model_dir: Path) -> None:
    """A few seconds of training make the quick start answer in words, not noise."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt = "Serving a language model has two"
    with torch.inference_mode():
        out = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=6,
                             do_sample=False)  # fmt: skip
    assert tokenizer.decode(out[0]).startswith(prompt + " phases")


def test_help_documents_all_three_modes() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for text in ("--backend", "--spec", "--served-model-name", "--profile", "--time-scale",
                 "tiny-model"):  # fmt: skip
        assert text in out.stdout


def test_the_kubellm_command_wires_the_engine_subcommand() -> None:
    from kubellm import cli

    args = cli.build_parser().parse_args(["engine", "--backend", "sim", "--port", "1"])
    assert args.func is engine_cli.run and args.backend == "sim"


@requires_engine_extra
def test_tiny_model_writes_a_checkpoint(tmp_path: Path) -> None:
    out = run_cli("tiny-model", str(tmp_path / "m"), "--train-steps", "0")
    assert out.returncode == 0, out.stderr
    assert tiny.is_built(tmp_path / "m")


def test_missing_model_path_fails_at_once_naming_it(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("model:\n  source: file:///no/such/model\n  servedName: x\n")
    out = run_cli("--spec", str(spec), "--port", "8000")
    assert out.returncode == 1
    assert "/no/such/model does not exist" in out.stderr


def test_unknown_sim_profile_is_a_clear_error() -> None:
    out = run_cli("--backend", "sim", "--profile", "nope", "--port", "1")
    assert out.returncode == 2 and "--profile 'nope'" in out.stderr


@pytest.mark.parametrize("args", [["tiny-model"], ["stray"]])
def test_bad_positional_use_is_refused(args: list[str]) -> None:
    assert run_cli(*args).returncode == 2


def test_sim_backend_serves_on_the_given_port_and_name_and_stops_on_sigterm() -> None:
    import signal

    import httpx

    from tests.fixtures.engines import free_port, wait_until

    port = free_port()
    command = [sys.executable, "-m", "kubellm.engine", "--backend", "sim", "--port", str(port),
               "--served-model-name", "llama", "--profile", "tiny-cpu",
               "--time-scale", "0"]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True)

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return process.poll() is not None

    try:
        wait_until(up, 60, "the simulator to listen")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
        assert [m["id"] for m in models["data"]] == ["llama"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert "SIMULATED engine" in process.stderr.read()
