"""The `kubellm` command: the composition root.

Core subcommands (`crds`, `plan`, `validate`) live here. Each component's
subcommand lives in that component's `cli` module (`kubellm.gateway.cli`,
...), which exposes `configure(parser)` and `run(args) -> int` and keeps its
imports light; this module imports it lazily and only to wire it in. A
component whose `cli` module does not exist yet answers with a clear message
and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kubellm import __version__, api, capacity, crd, kv_tiers, manifests

# name -> (module providing configure/run, one-line help)
COMPONENT_COMMANDS: dict[str, tuple[str, str]] = {
    "operator": ("kubellm.operator.cli", "Run the operator: reconcile LLMDeployments."),
    "gateway": ("kubellm.gateway.cli", "Run the OpenAI-compatible gateway."),
    "epp": (
        "kubellm.gateway.epp.cli",
        "Run the endpoint picker for Envoy-based gateways (Gateway API Inference Extension).",
    ),
    "autoscaler": ("kubellm.autoscaler.cli", "Run the KV-cache and queue-depth autoscaler."),
    "engine": ("kubellm.engine.cli", "Run an engine: vLLM from a spec, or the simulator."),
    "up": ("kubellm.fleet.up", "Run the whole control plane locally, without Kubernetes."),
    "status": ("kubellm.fleet.show", "Show the state of a local fleet or a gateway."),
    "render": ("kubellm.operator.render", "Print the Kubernetes objects for a manifest."),
    "rollout": (
        "kubellm.operator.rollout_cli",
        "Abort, promote or show a canary rollout of an LLMDeployment.",
    ),
    "bench": ("kubellm.bench", "Load-test an OpenAI-compatible endpoint."),
    "diagnose": ("kubellm.diagnose", "Explain what is slow in a fleet from its metrics."),
    "usage": ("kubellm.usage", "Print each tenant's usage and cost from a gateway's metrics."),
}


def _component(sub: Any, name: str, module_name: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    module = importlib.import_module(module_name)
    module.configure(parser)
    parser.set_defaults(func=module.run)


# --------------------------------------------------------------------------- crds


def _crds(args: argparse.Namespace) -> int:
    if args.stdout:
        sys.stdout.write(crd.render())
    else:
        print(crd.write(Path(args.output_dir)))
    return 0


# --------------------------------------------------------------------------- validate


def _validate(args: argparse.Namespace) -> int:
    status = 0
    for path in args.filename:
        try:
            for deployment in manifests.load(path):
                problem = api.extra_args_problem(deployment.spec.engine.extra_args)
                if problem is not None:  # refused by `render` and the operator too
                    print(f"{path}: {deployment.metadata.name}: {problem}", file=sys.stderr)
                    status = 1
                    continue
                print(f"{path}: {deployment.metadata.name} is a valid LLMDeployment")
        except manifests.ManifestError as error:
            print(error, file=sys.stderr)
            status = 1
    return status


# --------------------------------------------------------------------------- plan


def _number(kind: type, low: float, *, inclusive: bool = True, high: float | None = None) -> Any:
    """An argparse type: a finite number of `kind` in [low, high] (or (low, high])."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < low or (not inclusive and value == low):
            bound = f"at least {low:g}" if inclusive else f"more than {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:g}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


_COUNT = _number(int, 1)
_POSITIVE = _number(float, 0, inclusive=False)
_FRACTION = _number(float, 0, inclusive=False, high=1)


def _configure_plan(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    model = parser.add_argument_group("model (a config file, a known name, or explicit numbers)")
    model.add_argument("--model-config", metavar="PATH", help="Hugging Face config.json")
    model.add_argument(
        "--model", choices=sorted(capacity.KNOWN_MODELS), help="a well-known architecture"
    )
    model.add_argument("--layers", type=_COUNT, help="transformer layers")
    model.add_argument("--kv-heads", type=_COUNT, help="KV heads")
    model.add_argument("--head-dim", type=_COUNT, help="dimension of one attention head")
    model.add_argument(
        "--attention-heads", type=_COUNT, help="query heads (checks --tensor-parallel divides it)"
    )
    model.add_argument(
        "--params-billions", type=_POSITIVE, help="parameters (not needed with --weights-gib)"
    )
    model.add_argument(
        "--dtype", choices=sorted(capacity.WEIGHT_BITS), help="weight dtype (default: the config's)"
    )
    model.add_argument("--kv-dtype", choices=sorted(capacity.KV_BYTES), default="bf16")
    model.add_argument("--weights-gib", type=_POSITIVE, help="override the computed weight size")
    gpu = parser.add_argument_group("GPU")
    gpu.add_argument("--gpu-memory-gib", type=_POSITIVE, default=80.0, help="memory of one GPU")
    gpu.add_argument(
        "--usable-fraction", type=_FRACTION, default=0.9, help="share of it vLLM may use"
    )
    gpu.add_argument(
        "--bandwidth-gbps", type=_POSITIVE, default=2000.0, help="memory bandwidth, GB/s"
    )
    gpu.add_argument("--gpu-hour-price", type=_POSITIVE, help="dollars per GPU hour")
    gpu.add_argument("--tensor-parallel", type=_COUNT, default=1, help="GPUs per replica")
    gpu.add_argument(
        "--pipeline-parallel", type=_COUNT, default=1,
        help="pipeline stages of tensor-parallel GPU groups (a replica of TP x PP GPUs)",
    )  # fmt: skip
    gpu.add_argument(
        "--compare-shapes", type=_COUNT, metavar="GPUS_PER_NODE",
        help="compare the replica shapes (TP inside a node, PP across nodes) that fill 1 to "
        "--max-nodes nodes of this many GPUs; with --trace, by simulated goodput per GPU-hour "
        "at the SLO on the trace (smaller replicas too)",
    )  # fmt: skip
    gpu.add_argument("--max-nodes", type=_COUNT, default=4, help="with --compare-shapes")
    gpu.add_argument(
        "--gpu-tflops", type=_POSITIVE,
        help="dense bf16 TFLOPS of one GPU (--trace --compare-shapes: the simulated replicas' "
        "prefill; default 989, an H100 SXM)",
    )  # fmt: skip
    work = parser.add_argument_group("workload")
    work.add_argument("--context-tokens", type=_COUNT, default=4096, help="tokens per request")
    work.add_argument("--concurrency", type=_COUNT, help="concurrent requests to serve")
    work.add_argument(
        "--throughput-tokens-per-second", type=_POSITIVE, help="sustained output tok/s"
    )
    work.add_argument("--utilization", type=_FRACTION, default=1.0, help="share of the hour busy")
    work.add_argument("--api-price-per-million", type=_POSITIVE, help="API price per 1M tokens")
    tiers = parser.add_argument_group(
        "KV offload tiers (spec.engine.kvOffload; sessions are --context-tokens long)"
    )
    tiers.add_argument("--host-tier-gib", type=_POSITIVE, help="host-memory tier per replica")
    tiers.add_argument("--disk-tier-gib", type=_POSITIVE, help="disk tier per replica")
    tiers.add_argument(
        "--working-set-tokens", type=_COUNT,
        help="KV tokens the fleet's sessions keep warm (histories between turns): with "
        "--replicas, says whether host memory or more replicas holds them cheaper",
    )  # fmt: skip
    tiers.add_argument("--replicas", type=_COUNT, default=1, help="replicas of the fleet")
    tiers.add_argument(
        "--host-gib-hour-price", type=_POSITIVE, default=0.005,
        help="dollars per GiB-hour of host memory (cloud memory-optimised instances: "
        "about 0.004-0.008)",
    )  # fmt: skip
    tiers.add_argument(
        "--max-host-gib", type=_POSITIVE, default=200.0,
        help="host memory one replica can pin (an 8-GPU H100 node has 2 TiB: 256 per GPU, "
        "less the engine's own)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one flat JSON object")
    trace = parser.add_argument_group(
        "from a trace (--trace FILE: simulate the fleet on the trace; the model and workload "
        "flags are then not needed; --gpu-hour-price (default 2.5), --api-price-per-million "
        "(default 0.2, prompt and output) and --tensor-parallel apply)"
    )
    trace.add_argument("--trace", metavar="FILE",
                       help="requests: CSV (timestamp, prompt_tokens | input_tokens | "
                       "ContextTokens, output_tokens | GeneratedTokens; any case) or JSONL "
                       "(.jsonl) with the same fields")  # fmt: skip
    trace.add_argument("--rate-scale", type=float, metavar="X",
                       help="superpose X shifted copies of the trace (default 1)")  # fmt: skip
    trace.add_argument("--capacity", type=float, metavar="RPS",
                       help="requests/s one replica serves within the SLO (default: measured "
                       "on a simulated replica with the trace's request sizes)")  # fmt: skip
    trace.add_argument("--ttft", type=float, metavar="S", help="SLO: TTFT target (default 2)")
    trace.add_argument("--itl", type=float, metavar="S", help="SLO: mean ITL (default 0.1)")
    trace.add_argument("--load-seconds", type=float, metavar="S",
                       help="a new replica's time to ready (default 60)")  # fmt: skip
    trace.add_argument("--min-replicas", type=int, help="default 1")
    trace.add_argument("--max-replicas", type=int, help="default 8")
    trace.add_argument("--api-ttft", type=float, metavar="S", help="the API's TTFT (0.6)")
    trace.add_argument("--api-itl", type=float, metavar="S", help="the API's ITL (0.025)")
    trace.add_argument("--api-max-concurrency", type=int, metavar="N",
                       help="spec.fallback.maxConcurrency (default 64)")  # fmt: skip
    trace.add_argument("--interval", type=float, metavar="S",
                       help="the oracle fleet's interval (default 300)")  # fmt: skip
    trace.add_argument("--policies", metavar="P,...",
                       help="simulated: kv-queue (no fallback), kv-queue+fallback (the share "
                       "rule), kv-queue+fallback+cost (the cost rule), each also with "
                       "+predict (spec.autoscaling.predictive); default: kv-queue and "
                       "kv-queue+fallback+cost")  # fmt: skip
    trace.add_argument("--pd", type=int, metavar="REPLICAS",
                       help="also plan prefill/decode disaggregation on REPLICAS replicas: "
                       "whether the conditional split serves more of the trace than "
                       "aggregated serving on the same GPUs, and at which P:D")  # fmt: skip
    trace.add_argument("--pd-link-gbps", type=float, metavar="GBPS",
                       help="--pd: the KV link between the roles (default 45: RDMA)")  # fmt: skip
    trace.add_argument("--png", metavar="FILE", help="plot load, oracle and replicas")
    trace.add_argument("--seed", type=int, help="default 0")
    trace.add_argument("--calibrate", metavar="URL",
                       help="measure the running replica at URL (OpenAI-compatible; it gets "
                       "load: use your own): its capacity at the SLO for the trace's request "
                       "sizes, then simulate a replica with that capacity (its step costs "
                       "scaled to match) instead of the datasheet profile")  # fmt: skip
    trace.add_argument("--calibrate-model", metavar="NAME",
                       help="the model to ask for (default: the first /v1/models "
                       "lists)")  # fmt: skip
    trace.add_argument("--calibrate-start", type=float, metavar="RPS",
                       help="the first rate tried; it doubles while the SLO holds "
                       "(default 1)")  # fmt: skip
    trace.add_argument("--calibrate-seconds", type=float, metavar="S",
                       help="seconds of load per rate tried (default 30)")  # fmt: skip
    trace.add_argument("--calibrate-max-points", type=int, metavar="N",
                       help="rates tried in all, at most (default 10)")  # fmt: skip
    trace.add_argument("--calibrate-bisections", type=int, metavar="N",
                       help="bisections between the last rate that met the SLO and the "
                       "first that did not (default 3)")  # fmt: skip
    trace.add_argument("--calibrate-timeout", type=float, metavar="S",
                       help="a request's timeout (default 120)")  # fmt: skip
    trace.add_argument("--calibrate-prompt-tokens", type=int, metavar="N",
                       help="send prompts of about N tokens instead of the trace's")  # fmt: skip
    trace.add_argument("--calibrate-output-tokens", type=int, metavar="N",
                       help="ask N output tokens instead of the trace's")  # fmt: skip
    trace.add_argument("-f", "--filename", metavar="FILE",
                       help="an LLMDeployment: its spec.autoscaling, spec.slo, "
                       "spec.fallback.maxConcurrency and GPUs per replica, where the flags "
                       "leave them unset")  # fmt: skip


def _shape(args: argparse.Namespace) -> capacity.ModelShape:
    if args.model_config:
        path = Path(args.model_config)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise capacity.CapacityError(f"cannot read model config {path}: {error}") from None
        shape = capacity.shape_from_hf_config(config, name=path.parent.name or path.name)
    elif args.model:
        shape = capacity.known_model(args.model)
    else:
        explicit = {
            "--layers": args.layers,
            "--kv-heads": args.kv_heads,
            "--head-dim": args.head_dim,
            # The parameter count only sizes the weights: --weights-gib gives them directly.
            "--params-billions": args.params_billions or args.weights_gib,
        }
        missing = [flag for flag, value in explicit.items() if value is None]
        if missing:
            raise capacity.CapacityError(
                "give --model-config PATH, --model NAME, or all of "
                + ", ".join(missing)
                + (" (or --weights-gib)" if "--params-billions" in missing else "")
            )
        shape = capacity.ModelShape(
            num_layers=args.layers,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            params=(args.params_billions or 0.0) * 1e9,
            num_attention_heads=args.attention_heads,
        )
    if args.dtype:
        shape = capacity.ModelShape(**{**shape.__dict__, "dtype": args.dtype})
    return shape


def _gpu_and_workload(args: argparse.Namespace) -> tuple[capacity.GPUProfile, capacity.Workload]:
    gpu = capacity.GPUProfile(
        memory_gib=args.gpu_memory_gib,
        usable_fraction=args.usable_fraction,
        bandwidth_gbps=args.bandwidth_gbps,
        hour_price=args.gpu_hour_price,
    )
    return gpu, capacity.Workload(context_tokens=args.context_tokens)


def _compare_shapes(args: argparse.Namespace) -> int:
    """A table of replica shapes: weights and KV pool per GPU, sequences per replica and per
    GPU, one stream's decode bound; the shape with the most sequences per GPU is named."""
    try:
        shape = _shape(args)
        gpu, workload = _gpu_and_workload(args)
        rows = capacity.compare_shapes(
            shape, gpu, workload, capacity.shapes(args.compare_shapes, args.max_nodes),
            kv_dtype=args.kv_dtype,
        )  # fmt: skip
    except capacity.CapacityError as error:
        print(f"kubellm plan: {error}", file=sys.stderr)
        return 1
    print(f"{shape.name}, {args.context_tokens:,}-token requests, {args.gpu_memory_gib:g} GiB "
          f"GPUs at {args.bandwidth_gbps:g} GB/s, {args.compare_shapes} per node")  # fmt: skip
    print("| nodes | TP | PP | weights/GPU | KV pool/GPU | seqs/replica | seqs/GPU | "
          "decode tok/s/stream |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    fits = []
    for par, result in rows:
        nodes = par.gpus // args.compare_shapes
        if isinstance(result, str):
            print(f"| {nodes} | {par.tensor} | {par.pipeline} | {result} | | | | |")
            continue
        per_gpu = result.max_concurrent_sequences / par.gpus
        fits.append((per_gpu, result.decode_tokens_per_second_bound, par))
        print(f"| {nodes} | {par.tensor} | {par.pipeline} | "
              f"{result.weight_bytes_per_gpu / capacity.GIB:.1f} GiB | "
              f"{result.kv_pool_bytes_per_gpu / capacity.GIB:.1f} GiB | "
              f"{result.max_concurrent_sequences:,} | {per_gpu:.1f} | "
              f"{result.decode_tokens_per_second_bound:.1f} |")  # fmt: skip
    if not fits:
        print("no shape fits: more nodes (--max-nodes), quantized weights or a shorter context")
        return 1
    _, speed, best = max(fits, key=lambda f: (f[0], f[1]))
    print(
        f"most sequences per GPU: TP {best.tensor} x PP {best.pipeline} "
        f"({best.gpus} GPUs, {speed:.1f} tokens/s per stream)"
    )
    return 0


def _fmt_bytes(value: float) -> str:
    return f"{value / capacity.GIB:,.2f} GiB ({value:,.0f} B)"


def _plan(args: argparse.Namespace) -> int:
    if args.trace and args.compare_shapes:
        from kubellm.simulation import shapes

        try:
            return shapes.main(args, _shape(args))
        except capacity.CapacityError as error:
            print(f"kubellm plan: {error}", file=sys.stderr)
            return 1
    if args.trace or args.calibrate:
        # the fleet simulation composes components: imported here, for this command only
        from kubellm.simulation import plan as trace_plan

        args.trace = Path(args.trace) if args.trace else None
        args.png = Path(args.png) if args.png else None
        return trace_plan.main(args)
    if args.compare_shapes:
        return _compare_shapes(args)
    try:
        shape = _shape(args)
        result = capacity.plan(
            shape,
            capacity.GPUProfile(
                memory_gib=args.gpu_memory_gib,
                usable_fraction=args.usable_fraction,
                bandwidth_gbps=args.bandwidth_gbps,
                hour_price=args.gpu_hour_price,
            ),
            capacity.Workload(
                context_tokens=args.context_tokens,
                concurrency=args.concurrency,
                throughput_tps=args.throughput_tokens_per_second,
                utilization=args.utilization,
                api_price_per_million=args.api_price_per_million,
            ),
            kv_dtype=args.kv_dtype,
            weights_override=round(args.weights_gib * capacity.GIB) if args.weights_gib else None,
            parallel=capacity.Parallelism(args.tensor_parallel, args.pipeline_parallel),
        )
    except capacity.CapacityError as error:
        print(f"kubellm plan: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({k: v for k, v in result.__dict__.items() if v is not None}))
        return 0
    params = f"{shape.params / 1e9:.2f}B params" if shape.params else "weights given"
    rows = [
        ("model", f"{shape.name}: {shape.num_layers} layers, {shape.num_kv_heads} KV heads, "
                  f"head dim {shape.head_dim}, {params}, {shape.dtype}"),
        ("KV cache per token", f"{result.kv_bytes_per_token:,} B"),
        (f"KV cache per {args.context_tokens:,}-token request",
         _fmt_bytes(result.kv_bytes_per_request)),
        ("weights", _fmt_bytes(result.weight_bytes)),
        (f"KV pool ({args.gpu_memory_gib:g} GiB x {args.tensor_parallel} GPU x "
         f"{args.usable_fraction:g} usable - weights)", _fmt_bytes(result.kv_pool_bytes)),
        ("concurrent sequences per replica", f"{result.max_concurrent_sequences:,}"),
        (f"decode bound per stream ({args.bandwidth_gbps:g} GB/s)",
         f"{result.decode_tokens_per_second_bound:,.1f} tokens/s"),
    ]  # fmt: skip
    if result.replicas_needed is not None:
        rows.append((f"replicas for {args.concurrency:,} concurrent requests",
                     f"{result.replicas_needed} ({result.replicas_needed * args.tensor_parallel} "
                     f"GPUs)"))  # fmt: skip
    if result.cost_per_million_tokens is not None:
        rows.append((f"cost per million output tokens at {args.utilization:.0%} utilization",
                     f"${result.cost_per_million_tokens:,.2f}"))  # fmt: skip
    if result.break_even_utilization is not None:
        even = result.break_even_utilization
        rows.append((f"break-even utilization vs ${args.api_price_per_million:g}/M API",
                     f"{even:.0%}" if even <= 1 else
                     f"never: the API is cheaper at any utilization (even 100% busy costs "
                     f"{even:.1f}x the API's price)"))  # fmt: skip
    rows += _tier_rows(args, result)
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


def _tier_rows(args: argparse.Namespace, result: capacity.Plan) -> list[tuple[str, str]]:
    """Each tier's tokens and sessions; with --working-set-tokens, host memory or replicas."""
    if not (args.host_tier_gib or args.disk_tier_gib or args.working_set_tokens):
        return []
    per_token = result.kv_bytes_per_token
    tiers = kv_tiers.tier_capacity(
        per_token, result.kv_pool_bytes, args.host_tier_gib or 0.0, args.disk_tier_gib or 0.0
    )
    sessions = tiers.sessions(args.context_tokens)
    rows = [
        (f"KV tokens per replica: {tier}", f"{tokens:,} ({sessions[tier]:,} sessions of "
         f"{args.context_tokens:,} tokens)")
        for tier, tokens in zip(kv_tiers.TIERS, (tiers.gpu_tokens, tiers.host_tokens,
                                                  tiers.disk_tokens), strict=True)
        if tokens or tier == kv_tiers.GPU
    ]  # fmt: skip
    if args.working_set_tokens:
        price = (args.gpu_hour_price or 0.0) * result.gpus_per_replica
        verdict = kv_tiers.host_or_replicas(
            args.working_set_tokens, per_token, tiers.gpu_tokens, args.replicas,
            replica_hour_price=price, host_gib_hour_price=args.host_gib_hour_price,
            max_host_gib=args.max_host_gib,
        )  # fmt: skip
        if not verdict.extra_replicas:
            answer = "the GPU pools hold it: no tier needed"
        else:
            host = (f"{verdict.host_gib_per_replica:,.1f} GiB host tier per replica "
                    f"(${verdict.host_hour_price:,.2f}/h for the fleet)")  # fmt: skip
            more = f"{verdict.extra_replicas} more replicas"
            if price:
                more += f" (${verdict.extra_replicas * price:,.2f}/h)"
            if not verdict.fits_host:
                answer = f"{more}: {host} is over --max-host-gib {args.max_host_gib:g}"
            elif verdict.host_is_cheaper or not price:
                answer = f"{host}, not {more}"
            else:
                answer = f"{more}, not {host}"
        rows.append((f"working set of {args.working_set_tokens:,} tokens on "
                     f"{args.replicas} replicas", answer))  # fmt: skip
        rows.append(("  (a tier holds sessions between turns)",
                     "running requests still need the GPU pools"))  # fmt: skip
    return rows


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubellm",
        description="kubellm: a control plane for self-hosted LLM fleets on vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"kubellm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    crds = sub.add_parser(
        "crds",
        help="Write the LLMDeployment CRD generated from the API models.",
        description="Write crds/llmdeployments.kubellm.io.yaml from kubellm/api.py.",
    )
    crds.add_argument("--output-dir", default="crds", help="directory to write (default: crds)")
    crds.add_argument("--stdout", action="store_true", help="print instead of writing")
    crds.set_defaults(func=_crds)

    validate = sub.add_parser(
        "validate",
        help="Check LLMDeployment manifests with the same rules as the CRD.",
        description="Check LLMDeployment manifests; errors name the offending field.",
    )
    validate.add_argument("-f", "--filename", action="append", required=True, metavar="FILE")
    validate.set_defaults(func=_validate)

    plan = sub.add_parser(
        "plan",
        help="Capacity planner: KV cache, concurrency, bandwidth bound, replicas, cost.",
        description="Size replicas for a model, a GPU and a workload, from first principles.",
    )
    _configure_plan(plan)
    plan.set_defaults(func=_plan)

    for name, (module_name, help_text) in COMPONENT_COMMANDS.items():
        _component(sub, name, module_name, help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
