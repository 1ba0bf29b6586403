"""`kubellm bench`: load-test any OpenAI-compatible endpoint (gateway, vLLM, hosted API).

Modes: a fixed request rate (Poisson, or gamma with --burstiness), a fixed
concurrency, or a sweep of rates. Workloads come from `workloads`, requests are
streamed and timed by `runner`, figures computed by `stats` (same definitions
as `vllm bench serve`), and shown by `report`. Imports stay light here:
`kubellm` loads this module to build its parser.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

WORKLOADS = ("random", "shared-prefix", "multi-turn", "trace")


def _span(text: str) -> tuple[int, int]:
    """'N' or 'LOW:HIGH' -> (low, high)."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH, got {text!r}") from None
    if len(parts) == 1:
        return parts[0], parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH, got {text!r}")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected R1,R2,..., got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be positive numbers")
    return rates


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="base URL (http://host:port or .../v1)")
    parser.add_argument("--model", required=True, help="model name to request")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    mode = parser.add_argument_group("load (choose one of --rate, --concurrency, --sweep)")
    mode.add_argument("--rate", type=float, help="requests per second (inf: all at once)")
    mode.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival times; 1 = Poisson (default)",
    )
    mode.add_argument(
        "--concurrency", type=int, help="requests in flight (alone: closed loop; with --rate: cap)"
    )
    mode.add_argument("--sweep", type=_rates, metavar="R1,R2,...", help="one run per rate")
    bound = parser.add_argument_group("bounds (default: 100 requests)")
    bound.add_argument("--num-requests", type=int, help="requests per run")
    bound.add_argument("--duration", type=float, metavar="S", help="stop sending after S seconds")
    bound.add_argument("--request-timeout", type=float, default=300.0, metavar="S")
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="random")
    work.add_argument(
        "--input-len",
        type=_span,
        default=(128, 128),
        metavar="N|LOW:HIGH",
        help="prompt tokens (default 128)",
    )
    work.add_argument(
        "--output-len",
        type=_span,
        default=(64, 64),
        metavar="N|LOW:HIGH",
        help="max_tokens per request (default 64)",
    )
    work.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: prefixes")
    work.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens")
    work.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: tokens")
    work.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session")
    work.add_argument("--trace", metavar="FILE.jsonl", help="trace: requests to replay")
    work.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a local tokenizer: exact prompt lengths (default: words)",
    )
    work.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask vLLM to always generate max_tokens (vLLM extension)",
    )
    work.add_argument("--seed", type=int, default=0)
    slo = parser.add_argument_group("goodput (DistServe: requests meeting both targets)")
    slo.add_argument("--ttft-target", type=float, metavar="S")
    slo.add_argument("--itl-target", type=float, metavar="S", help="per-request mean ITL (TPOT)")
    parser.add_argument(
        "--http-client",
        choices=("auto", "aiohttp", "httpx"),
        default="auto",
        help="auto: aiohttp when installed (less client latency), else httpx",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the results as JSON")
    out.add_argument("--plot", metavar="FILE.png", help="write latency and goodput charts")
    out.add_argument("--quiet", action="store_true", help="no progress indicator")


def _jsonable(value: Any) -> Any:
    """Infinite rates as the string "inf": JSON has no infinity."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _fail(message: str) -> int:
    print(f"kubellm bench: {message}", file=sys.stderr)
    return 2


def _loads(args: argparse.Namespace, has_timestamps: bool) -> list[dict[str, Any]]:
    """The runs to make: [{rate, concurrency}] (rate None = trace timing or closed loop)."""
    chosen = [n for n, v in (("--rate", args.rate), ("--sweep", args.sweep)) if v is not None]
    if len(chosen) > 1:
        raise ValueError("give one of --rate and --sweep")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency: must be at least 1")
    if args.burstiness <= 0:
        raise ValueError("--burstiness: must be positive")
    if args.rate is not None and args.rate <= 0:
        raise ValueError("--rate: must be positive (or inf)")
    if args.sweep:
        return [{"rate": r, "concurrency": args.concurrency} for r in args.sweep]
    if args.rate is not None:
        return [{"rate": args.rate, "concurrency": args.concurrency}]
    if args.concurrency is not None:
        return [{"rate": None, "concurrency": args.concurrency}]
    if has_timestamps:
        return [{"rate": None, "concurrency": None}]
    raise ValueError("give --rate R, --concurrency N or --sweep R1,R2,...")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import importlib.util
    import json
    from pathlib import Path

    from kubellm.bench import report, runner, stats, workloads

    if args.num_requests is not None and args.num_requests < 1:
        return _fail("--num-requests: must be at least 1")
    if args.duration is not None and args.duration <= 0:
        return _fail("--duration: must be positive")
    if args.http_client == "aiohttp" and importlib.util.find_spec("aiohttp") is None:
        return _fail("--http-client aiohttp: aiohttp is not installed")
    text_maker: workloads.TextMaker = workloads.word_text
    if args.tokenizer:
        try:
            from transformers import AutoTokenizer

            text_maker = workloads.tokenizer_text(AutoTokenizer.from_pretrained(args.tokenizer))
        except (OSError, ValueError, ImportError) as error:
            return _fail(f"--tokenizer: cannot load {args.tokenizer}: {error}")

    def build(seed: int, num: int) -> list[workloads.Conversation]:
        spec = workloads.WorkloadSpec(
            kind=args.workload,
            num_requests=num,
            input_len=args.input_len,
            output_len=args.output_len,
            num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            turns=args.turns,
            trace=args.trace,
            seed=seed,
        )
        return workloads.build(spec, text_maker)

    try:
        probe = build(args.seed, args.num_requests or 100)
        loads = _loads(args, any(c.at is not None for c in probe))
    except (ValueError, workloads.BenchError) as error:
        return _fail(str(error))
    target = runner.Target(
        url=args.url,
        model=args.model,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        timeout_s=args.request_timeout,
    )
    summaries = []
    for index, load in enumerate(loads):
        num = args.num_requests
        if num is None:  # bounded by duration: enough requests to fill it, capped
            rate = load["rate"]
            if args.duration and rate is not None and not math.isinf(rate):
                num = min(100_000, math.ceil(rate * args.duration * 1.5) + 10)
            else:
                num = 10_000 if args.duration else 100
        seed = args.seed + index  # fresh prompts per run: no prefix-cache reuse across runs
        reuse = index == 0 and num == workloads.count_requests(probe)
        conversations = probe if reuse else build(seed, num)
        schedule = runner.Schedule(
            rate=load["rate"] if load["rate"] is not None else math.inf,
            burstiness=args.burstiness,
            concurrency=load["concurrency"],
            duration_s=args.duration,
            seed=seed,
            use_timestamps=load["rate"] is None and load["concurrency"] is None,
        )
        label = {"rate": load["rate"], "concurrency": load["concurrency"]}
        progress = runner.Progress(
            workloads.count_requests(conversations), f"bench {report.load_label(label)}"
        )
        on_result = None if args.quiet else progress.update
        results, duration = asyncio.run(
            runner.run_once(
                conversations, target, schedule, on_result, http_client=args.http_client
            )
        )
        if not args.quiet:
            progress.close()
        summaries.append(
            stats.summarize(
                results,
                duration,
                ttft_target=args.ttft_target,
                itl_target=args.itl_target,
                label=label,
            )
        )
    print(report.table(summaries))
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(_jsonable({"config": config, "runs": summaries}), indent=2, default=str)
            + "\n"
        )
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        report.plot(summaries, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if any(s["completed"] for s in summaries) else 1
