"""`kubellm plan --trace FILE --compare-shapes GPUS_PER_NODE`: the replica shape with the
most goodput per GPU-hour at the SLO on a trace.

For a model and a GPU type, each candidate shape (tensor parallelism inside a node,
pipeline stages for the rest: replicas of 1, 2, 4 ... GPUs up to `--max-nodes` nodes) gets
a simulated replica derived from the datasheet figures by the formula the named simulator
profiles use (`kubellm.engine.sim_profiles.for_shape`), and its capacity at the SLO is
measured on the trace's own request sizes as `kubellm plan --trace` measures one replica's
(`plan.calibrate_capacity`: the highest Poisson rate at which 99% of requests meet both
targets). Goodput per GPU-hour = that rate x 3,600 / the replica's GPUs: what a GPU-hour
buys in requests served within the SLO, whatever the fleet's size. Data parallelism of a
dense model is more replicas of one shape, so it does not change the figure; a
mixture-of-experts model's DP x EP shapes are not compared (the capacity arithmetic has no
expert model). Pure but for the simulations' time; `text` formats the table.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

from kubellm import api, capacity
from kubellm.engine import sim_profiles
from kubellm.simulation import plan, traces

# The datasheet's dense bf16 peak when --gpu-tflops is not given: an H100 SXM's.
DEFAULT_TFLOPS = 989.0
# Request sizes drawn from the trace for the capacity runs (seeded), as --calibrate draws.
SIZES = 200


@dataclass(frozen=True)
class ShapeRow:
    tensor: int
    pipeline: int
    gpus: int
    capacity_rps: float | None = None  # requests/s at the SLO (None: does not fit)
    step_ms: float | None = None  # the derived replica's decode step at batch 1
    why: str = ""

    @property
    def per_gpu_hour(self) -> float | None:
        if self.capacity_rps is None:
            return None
        return self.capacity_rps * 3600 / self.gpus


def candidates(gpus_per_node: int, max_nodes: int) -> list[capacity.Parallelism]:
    """Replicas of 1, 2, 4 ... GPUs inside a node (tensor parallel), then the shapes that
    fill 1..max_nodes whole nodes (capacity.shapes: TP inside a node, PP for the rest)."""
    small, tensor = [], 1
    while tensor < gpus_per_node:
        small.append(capacity.Parallelism(tensor=tensor, pipeline=1))
        tensor *= 2
    return small + capacity.shapes(gpus_per_node, max_nodes)


def compare(
    shape: capacity.ModelShape,
    sizes: list[tuple[int, int]],
    slo: api.SLO,
    shapes: list[capacity.Parallelism],
    *,
    gpu_gib: float,
    bandwidth_gbps: float,
    tflops: float,
    seed: int = 0,
) -> list[ShapeRow]:
    """Each shape's capacity at the SLO for requests sized as `sizes` (prompt, output)."""
    rows = []
    arrivals = [traces.Arrival(0.0, p, o) for p, o in sizes]
    for par in shapes:
        base = ShapeRow(par.tensor, par.pipeline, par.gpus)
        if par.pipeline > shape.num_layers:
            rows.append(ShapeRow(**{**base.__dict__, "why": "more stages than layers"}))
            continue
        try:
            profile = sim_profiles.for_shape(
                shape, par.tensor, par.pipeline, gpu_gib=gpu_gib,
                bandwidth_gbps=bandwidth_gbps, bf16_tflops=tflops,
            )  # fmt: skip
            rate = plan.calibrate_capacity(arrivals, slo, seed, profile=profile)
        except capacity.CapacityError:
            rows.append(ShapeRow(**{**base.__dict__, "why": "weights do not fit"}))
            continue
        except ValueError:  # no rate meets the SLO
            rate = 0.0
        step = profile.step_seconds(0, 1) * 1000
        rows.append(ShapeRow(par.tensor, par.pipeline, par.gpus, rate, step))
    return rows


def best(rows: list[ShapeRow]) -> ShapeRow | None:
    """The most goodput per GPU-hour; ties go to the fewer GPUs per replica."""
    fits = [r for r in rows if r.per_gpu_hour]
    return max(fits, key=lambda r: (r.per_gpu_hour, -r.gpus)) if fits else None


def text(rows: list[ShapeRow], heading: str, gpus_per_node: int) -> str:
    lines = [heading, "| GPUs | nodes | TP | PP | step (batch 1) | req/s at SLO | "
             "req per GPU-hour |", "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        head = f"| {r.gpus} | {-(-r.gpus // gpus_per_node)} | {r.tensor} | {r.pipeline} |"
        if r.capacity_rps is None:
            lines.append(f"{head} {r.why} | | |")
            continue
        lines.append(f"{head} {r.step_ms:.1f} ms | {r.capacity_rps:.1f} | "
                     f"{r.per_gpu_hour:,.0f} |")  # fmt: skip
    chosen = best(rows)
    lines.append(
        f"best: TP {chosen.tensor} x PP {chosen.pipeline} ({chosen.gpus} GPUs per replica, "
        f"{chosen.per_gpu_hour:,.0f} requests per GPU-hour within the SLO)"
        if chosen
        else "no shape meets the SLO: more nodes (--max-nodes), a larger GPU or a looser SLO"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace, shape: capacity.ModelShape) -> int:
    """`kubellm plan --trace FILE --compare-shapes N` with the model's shape (kubellm/cli.py
    reads it from --model, --model-config or the explicit numbers)."""
    plan._defaults(args)
    problem = plan._check(args)
    if problem:
        return plan._fail(problem)
    try:
        trace = traces.read_file(Path(args.trace), args.rate_scale, args.seed)
    except traces.TraceError as error:
        return plan._fail(f"--trace: {error}")
    arrivals = trace.arrivals(args.seed)
    if not arrivals:
        return plan._fail(f"--trace {args.trace}: no requests")
    rng = random.Random(f"shapes/{args.seed}")
    picked = rng.sample(arrivals, min(SIZES, len(arrivals)))
    sizes = [(a.prompt_tokens, a.output_tokens) for a in picked]
    slo = api.SLO(ttft_seconds=args.ttft, itl_seconds=args.itl)
    tflops = args.gpu_tflops or DEFAULT_TFLOPS
    rows = compare(
        shape, sizes, slo, candidates(args.compare_shapes, args.max_nodes),
        gpu_gib=args.gpu_memory_gib, bandwidth_gbps=args.bandwidth_gbps, tflops=tflops,
        seed=args.seed,
    )  # fmt: skip
    heading = (
        f"{shape.name} on {args.gpu_memory_gib:g} GiB GPUs ({args.bandwidth_gbps:g} GB/s, "
        f"{tflops:g} TFLOPS bf16), {args.compare_shapes} per node; trace {args.trace} "
        f"({len(arrivals)} requests, sizes of {len(sizes)}); SLO TTFT {slo.ttft_seconds:g} s, "
        f"ITL {slo.itl_seconds:g} s at {plan.OBJECTIVE:.0%}"
    )
    print(text(rows, heading, args.compare_shapes))
    return 0 if best(rows) else 1
