"""The shadow step's answer comparison on real vLLM (CPU, the tiny checkpoint): how far a
revision's greedy answers agree with the stable one's, and what the quality gate says.

Revisions (each beside the stable checkpoint, one vLLM pair at a time):
- `same`: the same checkpoint on a second engine (the noise floor);
- `bf16`: the same checkpoint served in bfloat16 instead of float32 (a dtype change);
- `4bit`: every weight rounded to 4 bits (per-tensor symmetric, 15 levels): a quantization
  that loses quality;
- `fewer-steps`: the checkpoint trained for a quarter of the steps (a worse fine-tune).

For each: `--requests` prompts from the tiny model's corpus are sent to both engines the
way the gateway's mirror sends them (`mirror.greedy_body`, top-5 logprobs, at most 2k
tokens), compared with `mirror`'s functions, and judged by `rollout.quality_verdict` with
the default thresholds; it prints agreement, per-token agreement, divergence, the canary's
time per output token over stable's, the verdict, and after how many mirrored requests the
verdict was reached (the smallest n from 10 at which a gate with minMirroredRequests n
gives it). Run under `flock /tmp/vllm.lock` (two engines, ~5 GiB each, minutes to start).

    flock /tmp/vllm.lock .venv/bin/python -m bench.shadow_quality --requests 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

K = 16  # the mirror's first tokens (the default shadow.firstTokens)


def round_to_4_bits(source: Path, target: Path) -> None:
    """Copy the checkpoint at `source` with every floating weight tensor rounded to 15
    levels (symmetric, per tensor, scale absmax / 7)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target, dirs_exist_ok=True)
    for path in target.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                scale = tensor.abs().max() / 7
                if scale > 0:
                    tensors[name] = (torch.round(tensor / scale).clamp(-7, 7) * scale).to(
                        tensor.dtype
                    )
        save_file(tensors, path, metadata={"format": "pt"})


def prompts(count: int) -> list[str]:
    """Starts of the corpus' sentences: prompts the tiny model has an answer to."""
    from kubellm.engine import corpus

    words = corpus.CORPUS.split()
    out = []
    for i in range(count):
        start = (i * 37) % max(len(words) - 12, 1)
        out.append(" ".join(words[start : start + 6 + i % 6]))
    return out


async def compare(stable: str, canary: str, texts: list[str]) -> list[dict[str, Any]]:
    import aiohttp
    from kubellm.gateway.routing.canary import mirror

    rows = []
    async with aiohttp.ClientSession() as session:
        post = mirror.aiohttp_post(lambda: session)
        for text in texts:
            body = mirror.greedy_body({"model": "tiny", "prompt": text}, False, K)
            (a, a_time), (b, b_time) = await asyncio.gather(
                post(stable, "/v1/completions", body), post(canary, "/v1/completions", body)
            )
            s_tokens, s_chosen, _, s_count = mirror.answer_tokens(a, 2 * K)
            c_tokens, _, c_tops, c_count = mirror.answer_tokens(b, 2 * K)
            compared, agreed = mirror.token_agreement(s_tokens, c_tokens)
            div = mirror.divergence(s_chosen or [], c_tops or [])
            rows.append({
                "agree": mirror.first_k_agree(s_tokens, c_tokens, K),
                "tokens": compared, "tokens_agreed": agreed, "div": div,
                "stable_tpot": a_time / max(s_count, 1), "canary_tpot": b_time / max(c_count, 1),
            })  # fmt: skip
    return rows


def judge(rows: list[dict[str, Any]]) -> tuple[str, int | None]:
    """The quality gate's verdict over all rows, and the first n (from 10) giving it."""
    from kubellm.operator import rollout

    from kubellm import api

    def verdict(part: list[dict[str, Any]], need: int) -> str:
        detail = {
            "mirrored|short": float(len(part)),
            "agreed|short": float(sum(r["agree"] for r in part)),
            "tokens": float(sum(r["tokens"] for r in part)),
            "tokens_agreed": float(sum(r["tokens_agreed"] for r in part)),
            "divergence_sum": float(sum(sum(r["div"]) for r in part)),
            "divergence_count": float(sum(len(r["div"]) for r in part)),
        }
        analysis = api.RolloutAnalysis.model_validate(
            {"minClassRequests": 1, "quality": {"minMirroredRequests": need}}
        )
        got = rollout.quality_verdict(rollout.Counters(detail=detail), None, analysis, K)
        return "Pass" if got is None else f"{got.result} ({got.reason})"

    final = verdict(rows, min(len(rows), 50))
    for n in range(10, len(rows) + 1):
        if verdict(rows[:n], n) == final:
            return final, n
    return final, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60, help="prompts per revision (60)")
    parser.add_argument("--only", nargs="*", default=None, help="revisions to run (all)")
    args = parser.parse_args(argv)
    from kubellm.engine import tiny

    from tests.fixtures import engines

    engines.VLLM_START_TIMEOUT_S = 900.0  # a first start compiles (minutes on a busy machine)
    base = engines.ensure_tiny_model()
    texts = prompts(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        variants: dict[str, tuple[Path, str]] = {
            "same": (base, "float32"),
            "bf16": (base, "bfloat16"),
        }
        if not args.only or "4bit" in args.only:
            round_to_4_bits(base, work / "4bit")
            variants["4bit"] = (work / "4bit", "float32")
        if not args.only or "fewer-steps" in args.only:
            tiny.build(work / "fewer", train_steps=tiny.TRAIN_STEPS // 4)
            variants["fewer-steps"] = (work / "fewer", "float32")
        wanted = {k: v for k, v in variants.items() if not args.only or k in args.only}
        stable_spec = engines.tiny_spec(base)
        print(f"load average {os.getloadavg()[0]:.1f}; {args.requests} prompts per revision")
        print("| revision | agreement (first 16) | per-token | divergence nats/token "
              "| canary/stable time per token | verdict | after n |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- |")
        with engines.running_vllm(stable_spec, Path(tempfile.mkdtemp(dir=tmp))) as stable:
            for name, (directory, dtype) in wanted.items():
                spec = engines.tiny_spec(directory)
                spec["engine"]["dtype"] = dtype
                with engines.running_vllm(spec, Path(tempfile.mkdtemp(dir=tmp))) as canary:
                    rows = asyncio.run(compare(stable, canary, texts))
                n = len(rows)
                tokens = sum(r["tokens"] for r in rows)
                div = [d for r in rows for d in r["div"]]
                ratio = sum(r["canary_tpot"] for r in rows) / max(
                    sum(r["stable_tpot"] for r in rows), 1e-9
                )
                verdict, after = judge(rows)
                print(f"| {name} | {sum(r['agree'] for r in rows) / n:.0%} | "
                      f"{sum(r['tokens_agreed'] for r in rows) / max(tokens, 1):.1%} | "
                      f"{sum(div) / max(len(div), 1):.4f} | {ratio:.2f} | {verdict} | "
                      f"{after} |", flush=True)  # fmt: skip
        print(json.dumps({"load_average": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
