"""`kubellm up`: the control plane on one machine, engines as local processes.

    kubellm up -f examples/tiny-cpu.yaml                 # real vLLM on CPU
    kubellm up -f examples/tiny-cpu.yaml --engine sim    # the simulated engine

Manifests are validated with the same models (and messages) as the CRD before
anything starts. Then, in one asyncio loop: the supervisor keeps each
deployment's engine processes running, the gateway serves the OpenAI API and
/metrics on --port, and the autoscaler acts on deployments that enable it.
Ctrl-C or SIGTERM stops everything; no process is left behind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TINY_ANNOTATION = "kubellm.io/build-tiny-model"


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The epilog as written, and every option's default shown."""


def _sim_profiles() -> list[str] | None:
    try:
        from kubellm.engine.sim_profiles import PROFILES
    except ImportError:  # pragma: no cover - the engine package is part of this distribution
        return None
    return sorted(PROFILES)


def _profile_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    known = _sim_profiles() or []
    for name in names:
        if name not in known:
            raise argparse.ArgumentTypeError(
                f"--sim-profile {name!r} is unknown; known profiles: {', '.join(known)}"
            )
    return names


def _slowdown_list(text: str) -> tuple[float, ...]:
    try:
        factors = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sim-slowdown {text!r}: give numbers separated by commas, e.g. 1,1.5"
        ) from None
    if not all(0 < f < float("inf") for f in factors):
        raise argparse.ArgumentTypeError(f"--sim-slowdown {text!r}: factors must be positive")
    return factors


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _Help
    parser.epilog = __doc__.split("\n\n")[1]
    parser.add_argument(
        "-f", "--filename", action="append", required=True, metavar="FILE",
        help="LLMDeployment manifest (repeatable), the files kubectl apply takes",
    )  # fmt: skip
    from kubellm.engine.cli import sim_spec_note

    parser.add_argument(
        "--engine", choices=["vllm", "sim"], default="vllm",
        help="vllm: real vLLM processes (the engine-cpu extra); sim: the simulated engine. "
        + sim_spec_note("It"),
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=8080, help="gateway port (and /metrics)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway listen address")
    parser.add_argument(
        "--watch", action="store_true", help="re-apply the manifests when a file changes"
    )
    parser.add_argument(
        "--run-dir", default=".kubellm/run", help="engine logs, spec files and fleet state"
    )
    parser.add_argument(
        "--autoscale-period", type=float, default=5.0, metavar="SECONDS",
        help="how often the autoscaler reads the metrics and decides (deployments with "
        "spec.autoscaling)",
    )  # fmt: skip
    parser.add_argument(
        "--sim-time-scale", type=float, default=1.0,
        help="simulator: wall seconds per simulated second (0.1 runs ten times faster)",
    )  # fmt: skip
    parser.add_argument(
        "--sim-profile", type=_profile_list, metavar="NAME[,NAME...]",
        help="simulator hardware/model profile, or a comma list given to replicas in turn "
        "(replica i gets item i mod n: a100,h100 alternates); known: "
        + ", ".join(_sim_profiles() or [])
        + " (default: tiny-cpu for deployments with resources.gpu.count 0, else "
        "llama-3.1-8b-h100)",
    )  # fmt: skip
    parser.add_argument(
        "--sim-slowdown", type=_slowdown_list, metavar="X[,X...]",
        help="simulator: multiply every step cost by X, or a comma list given to replicas in "
        "turn (1,1,1,1.5: every fourth replica 1.5x slower)",
    )  # fmt: skip
    parser.add_argument(
        "--rollout-seconds", type=float, default=1.0, metavar="SECONDS",
        help="how often canary rollouts (spec.rollout.strategy Canary) are analysed and "
        "stepped, on the gateway's per-revision figures",
    )  # fmt: skip
    parser.add_argument(
        "--status-interval", type=float, default=5.0, metavar="SECONDS",
        help="how often to print the status table (0: never)",
    )  # fmt: skip


def load_manifests(paths: list[str]) -> list:  # -> list[api.LLMDeployment]
    """Every LLMDeployment in the files; ManifestError (naming the field) on the first bad one."""
    from kubellm import manifests

    found = []
    for path in paths:
        found.extend(manifests.load(path))
    names = [m.metadata.name for m in found]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise manifests.ManifestError(f"duplicate LLMDeployment names: {', '.join(duplicates)}")
    return found


def vllm_missing() -> str | None:
    """Why real vLLM cannot run here, or None when it can."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed. Install the CPU build with "
            "`pip install -e '.[engine-cpu]'` (see README), or run the simulated engine: "
            "kubellm up ... --engine sim"
        )
    return None


def group_refusal(deployments: list, engine: str) -> str | None:
    """Why `kubellm up --engine vllm` cannot run a replica that spans nodes: the local fleet
    runs one engine process per replica, and a vLLM group of one process per node (leader
    and headless workers) on one machine would need that machine to hold every node's
    share. The simulator stands in for a whole group (one simulated engine per replica on
    the group's profile)."""
    if engine != "vllm":
        return None
    for manifest in deployments:
        nodes = manifest.spec.resources.nodes
        if nodes > 1:
            return (
                f"{manifest.metadata.name}: spec.resources.nodes is {nodes}: the local fleet "
                "runs one vLLM process per replica, not a group of one per node; serve it on "
                "a cluster with the LeaderWorkerSet controller (docs/operations.md, 'Serving "
                "a model larger than one node'), or simulate it here with --engine sim "
                "(one simulated engine per group; --sim-profile llama-3.1-405b-2x8xh100 or "
                "deepseek-v3-dp16-ep-2x8xh100 for its hardware)"
            )
    return None


def prepare_models(deployments: list, engine: str, run_dir: str = ".kubellm/run") -> list[str]:
    """Build the tiny checkpoint where a manifest asks for it and it is missing."""
    from kubellm import sources

    notes = []
    for manifest in deployments:
        annotations = (manifest.metadata.model_extra or {}).get("annotations") or {}
        source = sources.parse_source(manifest.spec.model.source)
        path = source.local_path()
        if source.scheme != "file" or path is None or engine == "sim":
            continue
        if Path(path).exists():
            continue
        if str(annotations.get(TINY_ANNOTATION, "")).lower() != "true":
            raise FileNotFoundError(
                f"{manifest.metadata.name}: spec.model.source {manifest.spec.model.source!r}: "
                f"{path} does not exist"
            )
        build_tiny(Path(path), Path(run_dir) / "logs" / "tiny-build.log")
        notes.append(f"built the tiny checkpoint at {path}")
    return notes


def build_tiny(path: Path, log_path: Path) -> None:
    """Build the tiny checkpoint in a child process, showing its progress on stderr.

    A child, so torch and its threads never load into the fleet's own process (they
    would print leak warnings when it exits); its output goes to `log_path`.
    """
    import subprocess

    from kubellm.progress import Ticker

    log_path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".partial")
    argv = [sys.executable, "-m", "kubellm.engine.tiny", str(staging)]
    with (
        log_path.open("w") as log,
        Ticker(f"kubellm up: building the tiny checkpoint (log: {log_path})") as ticker,
    ):
        child = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert child.stdout is not None
        for line in child.stdout:
            log.write(line)
            log.flush()
            if line.startswith("tiny: ") and not line.startswith("tiny: built"):
                ticker.note(line.removeprefix("tiny: ").strip())
        if child.wait() != 0:
            ticker.finish("failed")
            raise RuntimeError(f"building the tiny checkpoint failed; see {log_path}")
    staging.replace(path)


def port_in_use(host: str, port: int) -> str | None:
    """Why the gateway cannot listen on host:port, in words, or None when it can."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        return f"--host {host!r} is not an address this machine has ({error.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return (
                    f"port {port} on {host} is already in use (another `kubellm up`? "
                    f"`kubellm status` tells): stop it, or choose another port with --port"
                )
            if error.errno == errno.EACCES:
                return f"port {port} needs privileges: choose one above 1023 with --port"
            return f"cannot listen on {host}:{port} ({error.strerror}): change --host or --port"
    return None


def run(args: argparse.Namespace) -> int:
    from kubellm import manifests

    try:
        deployments = load_manifests(args.filename)
    except manifests.ManifestError as error:
        print(f"kubellm up: {error}", file=sys.stderr)
        return 1
    if not deployments:
        print("kubellm up: no LLMDeployment in the given files", file=sys.stderr)
        return 1
    if why := group_refusal(deployments, args.engine):
        print(f"kubellm up: {why}", file=sys.stderr)
        return 1
    if args.engine == "vllm" and (why := vllm_missing()):
        print(f"kubellm up: {why}", file=sys.stderr)
        return 1
    if not 0 < args.port < 65536:
        print(f"kubellm up: --port must be in 1-65535, got {args.port}", file=sys.stderr)
        return 2
    if why := port_in_use(args.host, args.port):
        print(f"kubellm up: {why}", file=sys.stderr)
        return 1
    try:
        for note in prepare_models(deployments, args.engine, args.run_dir):
            print(f"kubellm up: {note}", flush=True)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as error:
        print(f"kubellm up: {error}", file=sys.stderr)
        return 1

    import asyncio

    from kubellm.fleet.main import serve

    return asyncio.run(serve(args, deployments))
