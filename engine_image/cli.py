"""`kubellm engine`: run vLLM from a spec, run the simulator, or write the tiny checkpoint.

    kubellm engine --spec FILE --port PORT             # vLLM (the image's entrypoint)
    kubellm engine --backend sim --port PORT --served-model-name NAME
                   [--profile NAME] [--time-scale X]   # the simulated engine
                   [--slowdown X]                      # ... X times slower
                   [--spec FILE]                       # ... simulating that spec
    kubellm engine tiny-model DIR                      # the tiny test checkpoint

Imports stay light here; vLLM, torch and the simulator load inside `run`.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kubellm import contracts
from kubellm.sources import SPEC_PATH

if TYPE_CHECKING:
    from kubellm.engine import sim_profiles


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n")[1]
    parser.add_argument(
        "action", nargs="?", choices=["tiny-model"], help="tiny-model DIR: write the checkpoint"
    )
    parser.add_argument("directory", nargs="?", help="where tiny-model writes (a folder)")
    parser.add_argument("--backend", choices=["vllm", "sim"], default="vllm")
    parser.add_argument(
        "--spec", metavar="FILE",
        help=f"LLMDeployment (or its spec), JSON or YAML (vllm default: {SPEC_PATH}; the "
        "simulator reads one only when given)",
    )  # fmt: skip
    parser.add_argument("--port", type=int, help="HTTP port (default: spec.engine.port; sim 8000)")
    parser.add_argument(
        "--host", help="listen address (default: 0.0.0.0 for vllm, 127.0.0.1 for sim)"
    )
    parser.add_argument("--served-model-name", help="model name clients send")
    parser.add_argument(
        "--kv-events-port", type=int, metavar="PORT",
        help="publish KV-cache events on PORT, replay on PORT+1 (default: the spec's "
        "routing.kvEventsPort when routing.prefixIndex is precise, else off; a local fleet "
        "gives each replica its own)",
    )  # fmt: skip
    parser.add_argument(
        "--node-rank", type=int, metavar="N",
        help="a replica spanning nodes (spec.resources.nodes > 1): this process's rank, 0 the "
        "leader that serves the API (default: LWS_WORKER_INDEX, set by the LeaderWorkerSet "
        "controller)",
    )  # fmt: skip
    parser.add_argument(
        "--master-addr", metavar="HOST",
        help="a replica spanning nodes: the leader's address (default: LWS_LEADER_ADDRESS)",
    )  # fmt: skip
    parser.add_argument(
        "--master-port", type=int, default=29501, metavar="PORT",
        help="a replica spanning nodes: the leader's torch.distributed port",
    )  # fmt: skip
    parser.add_argument(
        "--role", choices=["prefill", "decode"],
        help="a spec with spec.prefill: run this role's engine (its KV connector role and, on "
        "prefill, spec.prefill's overrides); the operator sets it",
    )  # fmt: skip
    parser.add_argument(
        "--kv-side-channel-port", type=int, metavar="PORT",
        help="--role: the NIXL side channel's port (default 5600; a local pair gives each "
        "engine its own)",
    )  # fmt: skip
    parser.add_argument(
        "--train-steps", type=int, metavar="N",
        help="tiny-model: training steps on the bundled corpus (default: a few seconds' worth; "
        "0: random weights)",
    )  # fmt: skip
    sim = parser.add_argument_group("simulator (--backend sim)")
    sim.add_argument(
        "--profile",
        help="llama-3.1-8b-h100 (the default), llama-3.1-8b-a100, llama-3.1-8b-l4, "
        "llama-3.1-70b-4xh100, llama-3.1-405b-2x8xh100, or tiny-cpu (the default for a --spec "
        "with resources.gpu.count 0)",
    )
    sim.add_argument(
        "--slowdown", type=float, default=1.0, metavar="X",
        help="multiply every step cost of the profile by X (1.5: a card 1.5x slower)",
    )  # fmt: skip
    sim.add_argument(
        "--time-scale", type=float, default=1.0,
        help="wall seconds per simulated second (0.1: ten times faster; 0: no waiting)",
    )  # fmt: skip
    sim.add_argument(
        "--block-size", type=int, help="override the profile's (and the spec's) KV block size"
    )
    sim.add_argument("--num-blocks", type=int, help="override the profile's KV pool size")
    sim.add_argument(
        "--slow-steps", type=float, metavar="X",
        help="misbehave on purpose: every engine step takes X times as long (a bad revision "
        "for a canary test)",
    )  # fmt: skip
    sim.add_argument(
        "--fail-prompts-over", type=int, metavar="TOKENS",
        help="misbehave on purpose: answer 500 to prompts longer than TOKENS",
    )  # fmt: skip
    sim.description = sim_spec_note()
    sim.add_argument(
        "--tokenizer", metavar="DIR",
        help="tokenize with this Hugging Face tokenizer instead of ~4 characters per token",
    )  # fmt: skip


def sim_spec_note(lead: str = "With --spec, the simulator") -> str:
    """What the simulator takes from a spec (for --help): the fields it models and ignores."""
    from kubellm.engine.sim_profiles import IGNORED_FIELDS, SPEC_FIELDS

    return (
        f"{lead} honours spec.engine {', '.join(SPEC_FIELDS)}; it ignores "
        f"{', '.join(IGNORED_FIELDS)} (the profile stands for the hardware and the model)."
    )


def _tiny(args: argparse.Namespace) -> int:
    if not args.directory:
        print("kubellm engine tiny-model: give the folder to write, e.g. "
              ".kubellm/models/tiny", file=sys.stderr)  # fmt: skip
        return 2
    from kubellm.engine import tiny

    steps = tiny.TRAIN_STEPS if args.train_steps is None else args.train_steps
    out = tiny.build(args.directory, train_steps=steps)
    print(f"{out}: tiny checkpoint {tiny.describe(out)} sha256 {tiny.fingerprint(out)[:12]}")
    return 0


def _vllm(args: argparse.Namespace) -> int:
    from kubellm.engine import launcher

    try:
        target = launcher.load_target(args.spec or SPEC_PATH)
        if args.served_model_name:
            target = launcher.EngineTarget(target.spec, args.served_model_name)
        host = args.host or "0.0.0.0"
        plan = launcher.build_command(
            target, port=args.port, host=host, kv_events_port=args.kv_events_port,
            node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
            role=args.role, side_channel_port=args.kv_side_channel_port,
        )  # fmt: skip
    except launcher.LaunchError as error:
        print(f"kubellm engine: {error}", file=sys.stderr)
        return 1
    port = plan.argv[plan.argv.index("--port") + 1]
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    health = f"http://{probe_host}:{port}/health" if plan.serves else None
    return launcher.run(plan, health_url=health)


def sim_profile(
    name: str | None, spec: str | None, role: str | None = None
) -> tuple[sim_profiles.Profile, str | None]:
    """The simulator's profile (named, or the default for the spec's hardware) with the
    spec's engine fields mapped on (`role`'s: the prefill role's overrides, the KV link),
    and the spec's served name (None without a spec)."""
    from kubellm.engine import launcher, sim_profiles

    from kubellm import capacity

    if spec is None:
        if role is not None:
            raise ValueError(f"--role {role}: give the --spec with spec.prefill")
        return sim_profiles.get(name or sim_profiles.default_for(cpu=False)), None
    try:
        target = launcher.load_target(spec)
        role_spec = launcher.role_spec(target.spec, role)
    except launcher.LaunchError as error:
        raise ValueError(str(error)) from None
    cpu = role_spec.resources.gpu.count == 0
    base = sim_profiles.get(name or sim_profiles.default_for(cpu))
    profile = sim_profiles.from_spec(base, role_spec.engine, cpu=cpu)
    profile = profile.with_overrides(max_loras=contracts.max_loras(target.spec))
    if role_spec.prefill is not None:
        profile = profile.with_overrides(
            kv_link_gbps=capacity.kv_link_gbps(role_spec.prefill.kv_connector)
        )
    return profile, target.served_name


def sim_adapters(spec: str | None) -> dict[str, str]:
    """The spec's adapters, name -> the path a pod loads it from, registered when the
    simulator starts (as the launcher's --lora-modules registers them with vLLM, which
    hashes an adapter's blocks with that path: the gateway's discovery gives the same
    one, `kubellm.sources.adapter_path`). Adapters no engine can load (s3://) are left out."""
    from kubellm.engine import launcher

    from kubellm.sources import adapter_path

    if spec is None:
        return {}
    target = launcher.load_target(spec).spec
    out = {}
    for adapter in target.adapters:
        try:
            out[adapter.name] = adapter_path(adapter.source, target.model.source)
        except ValueError:
            continue
    return out


def sim_kv_events_port(spec: str | None, port: int | None) -> int | None:
    """Where the simulator publishes KV events: --kv-events-port, else the spec's
    routing.kvEventsPort when its prefixIndex is precise (as the launcher turns vLLM's on)."""
    if port is not None or spec is None:
        return port
    from kubellm.engine import launcher

    routing = launcher.load_target(spec).spec.routing
    return routing.kv_events_port if routing.prefix_index == "precise" else None


def _sim(args: argparse.Namespace) -> int:
    from kubellm.engine import sim_server as server

    try:
        profile, served = sim_profile(args.profile, args.spec, args.role)
        profile = profile.slowed(args.slowdown)
        events_port = sim_kv_events_port(args.spec, args.kv_events_port)
        return server.serve(
            host=args.host or "127.0.0.1",
            port=args.port or 8000,
            served_model_name=args.served_model_name or served or "sim",
            profile=profile,
            time_scale=args.time_scale,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            tokenizer=args.tokenizer,
            adapters=sim_adapters(args.spec),
            kv_events_port=events_port,
            slow_steps=args.slow_steps,
            fail_prompts_over=args.fail_prompts_over,
            role=args.role,
        )
    except ValueError as error:
        print(f"kubellm engine: {error}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    if args.action == "tiny-model":
        return _tiny(args)
    if args.directory:
        print(f"kubellm engine: unexpected argument {args.directory!r}", file=sys.stderr)
        return 2
    return _sim(args) if args.backend == "sim" else _vllm(args)
