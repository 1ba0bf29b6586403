"""`kubellm render -f FILE`: print the objects the operator would create, as YAML.

For GitOps users and reviews: the same pure builders the operator runs, with
no cluster. Owner references are left out (they need the live object's uid). The
InferencePool, HTTPRoute and the pool's own endpoint picker of `spec.routing.inferencePool`
are shown as the operator creates them by default where the Gateway API Inference
Extension's CRDs are installed (one picker per pool; the operator's
`--shared-endpoint-picker` would replace the picker with that Service's name).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="FILE",
        help="LLMDeployment manifest (repeatable; multi-document files allowed)",
    )
    parser.add_argument(
        "--podmonitor",
        action="store_true",
        help="include the PodMonitor (the operator adds it when the Prometheus Operator's "
        "CRD is installed)",
    )
    parser.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")


def _dumper(yaml: Any) -> Any:
    """A safe YAML dumper that writes multi-line strings (the engine spec) as blocks."""

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def text(dumper: Any, value: str) -> Any:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return Dumper


def run(args: argparse.Namespace) -> int:
    import json

    import yaml

    from kubellm import manifests

    from . import builders

    objects = []
    try:
        for path in args.filename:
            for llmd in manifests.load(path):
                options = builders.Options(
                    podmonitor=args.podmonitor, inference_pool=True, http_route=True
                )
                objects += builders.build(llmd, options)
    except (manifests.ManifestError, builders.SpecError) as error:
        print(f"kubellm render: {error}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    else:
        sys.stdout.write(yaml.dump_all(objects, Dumper=_dumper(yaml), sort_keys=False))
    return 0
