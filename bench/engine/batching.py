"""The batching "bus", measured: vLLM CPU output tokens/s at 1, 8 and 32 concurrent
requests on the tiny checkpoint, against plain `transformers` `generate()` serving
the same checkpoint one request at a time; then the simulator's throughput
(bench/engine/sim_throughput.py).

    python -m bench.engine_batching [--skip-sim]

Starts one vLLM CPU server through the launcher on 127.0.0.1 (about a minute),
stops it at the end. Both engines use one torch thread (vLLM reserves the other
core for its front end), greedy decoding, 64 output tokens, EOS ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from kubellm.engine import tiny

from kubellm.fleet.processes import free_port

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / ".kubellm" / "models" / "tiny"
OUTPUT_TOKENS = 64
PROMPT = "The engine batches requests continuously. At each step the scheduler"
CONCURRENCY = (1, 8, 32)
START_TIMEOUT_S = 300


def start_vllm(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    spec = {
        "model": {"source": f"file://{MODEL_DIR}", "servedName": "tiny"},
        "engine": {"dtype": "float32", "maxModelLen": 1024, "maxNumSeqs": 64, "blockSize": 32,
                   "chunkedPrefill": {"maxNumBatchedTokens": 2048}},
        "resources": {"gpu": {"count": 0}},
    }  # fmt: skip
    (workdir / "spec.json").write_text(json.dumps(spec))
    port = free_port()
    log = open(workdir / "vllm.log", "wb")  # noqa: SIM115 (kept open for the child)
    process = subprocess.Popen(
        [sys.executable, "-m", "kubellm.engine", "--spec", str(workdir / "spec.json"),
         "--port", str(port), "--host", "127.0.0.1"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)  # waiting for vLLM to load (bench script, not a test)
    process.kill()
    raise SystemExit(f"vLLM did not start; see {workdir / 'vllm.log'}")


async def vllm_tokens_per_second(url: str, concurrency: int) -> float:
    requests = max(concurrency, 4)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": OUTPUT_TOKENS,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    queue = iter(range(requests))
    produced = 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            nonlocal produced
            for _ in queue:
                response = await client.post("/v1/completions", json=body)
                response.raise_for_status()
                produced += response.json()["usage"]["completion_tokens"]

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return produced / (time.perf_counter() - started)


def transformers_tokens_per_second(requests: int = 4) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    inputs = tokenizer(PROMPT, return_tensors="pt")
    produced = 0
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=4, do_sample=False)  # warm-up
        started = time.perf_counter()
        for _ in range(requests):
            out = model.generate(**inputs, max_new_tokens=OUTPUT_TOKENS,
                                 min_new_tokens=OUTPUT_TOKENS, do_sample=False)  # fmt: skip
            produced += out.shape[1] - inputs["input_ids"].shape[1]
    return produced / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-sim", action="store_true")
    args = parser.parse_args()
    if not tiny.is_built(MODEL_DIR):
        tiny.build(MODEL_DIR)
    baseline = transformers_tokens_per_second()
    rows = [("transformers generate(), 1 at a time", 1, baseline)]
    with tempfile.TemporaryDirectory() as tmp:
        process, url = start_vllm(Path(tmp))
        try:
            asyncio.run(vllm_tokens_per_second(url, 1))  # warm-up
            for concurrency in CONCURRENCY:
                rate = asyncio.run(vllm_tokens_per_second(url, concurrency))
                rows.append((f"vLLM CPU, {concurrency} concurrent", concurrency, rate))
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    print(f"\ntiny checkpoint ({tiny.describe(MODEL_DIR)}), {OUTPUT_TOKENS} output tokens, "
          f"{os.cpu_count()} CPUs shared")  # fmt: skip
    print(f"{'engine':<40} {'concurrency':>11} {'output tok/s':>13} {'vs generate()':>14}")
    for name, concurrency, rate in rows:
        print(f"{name:<40} {concurrency:>11} {rate:>13,.0f} {rate / baseline:>13.1f}x")
    if not args.skip_sim:
        from bench.engine import sim_throughput

        print()
        sim_throughput.main()


if __name__ == "__main__":
    main()
