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


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n")[1]
    parser.add_argument(
        "-f", "--filename", action="append", required=True, metavar="FILE",
        help="LLMDeployment manifest (repeatable), the files kubectl apply takes",
    )  # fmt: skip
    from kubellm.engine.cli import sim_spec_note

    parser.add_argument(
        "--engine", choices=["vllm", "sim"], default="vllm",
        help="vllm: real vLLM processes (the engine-cpu extra); sim: the simulated engine. "
        + sim_spec_note(),
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=8080, help="gateway port (and /metrics)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway listen address")
    parser.add_argument(
        "--watch", action="store_true", help="re-apply the manifests when a file changes"
    )
    parser.add_argument(
        "--run-dir", default=".kubellm/run", help="engine logs, spec files and fleet state"
    )
    parser.add_argument("--autoscale-period", type=float, default=5.0, metavar="SECONDS")
    parser.add_argument(
        "--sim-time-scale", type=float, default=1.0,
        help="simulator: wall seconds per simulated second (0.1 runs ten times faster)",
    )  # fmt: skip
    parser.add_argument("--sim-profile", help="simulator hardware/model profile")
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


def prepare_models(deployments: list, engine: str) -> list[str]:
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
        from kubellm.engine import tiny

        tiny.build(path)
        notes.append(f"built the tiny checkpoint at {path}")
    return notes


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
    if args.engine == "vllm" and (why := vllm_missing()):
        print(f"kubellm up: {why}", file=sys.stderr)
        return 1
    try:
        for note in prepare_models(deployments, args.engine):
            print(note, flush=True)
    except (FileNotFoundError, ValueError) as error:
        print(f"kubellm up: {error}", file=sys.stderr)
        return 1

    import asyncio

    from kubellm.fleet.main import serve

    return asyncio.run(serve(args, deployments))
