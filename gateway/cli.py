"""`kubellm gateway`: run the OpenAI-compatible gateway.

    kubellm gateway --port 8080 --static examples/gateway-static.yaml
    kubellm gateway --port 8080            # watch LLMDeployments and EndpointSlices

Imports stay light here; the app is built inside `run`.
"""

from __future__ import annotations

import argparse
import gc
import sys

# The cyclic GC's young-generation threshold in the gateway process (Python's default: 700).
YOUNG_COLLECTION_EVERY = 20_000


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument(
        "--static",
        metavar="FILE",
        help="serve the models listed in FILE instead of watching the cluster",
    )
    parser.add_argument(
        "--namespace",
        help="watch only this namespace (cluster mode; default: all namespaces)",
    )
    parser.add_argument(
        "--api-keys-file",
        metavar="FILE",
        help="require an API key: FILE holds sha256 hex digests of accepted keys, one a line",
    )
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    parser.add_argument("--max-queue", type=int, default=256, help="waiting requests per model")
    parser.add_argument(
        "--zero-replica-wait",
        type=float,
        default=60.0,
        help="seconds a request may wait for a model with no ready replica (scale from zero)",
    )
    parser.add_argument(
        "--max-waiting",
        type=float,
        default=8.0,
        help="engine queue depth at which a replica counts as saturated",
    )
    parser.add_argument(
        "--max-kv-usage",
        type=float,
        default=0.95,
        help="KV-cache usage at which a replica counts as saturated",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="gateway requests per replica at which it counts as saturated (default: no cap)",
    )
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--log-level", default="warning")


def _api_key_hashes(path: str | None) -> frozenset[str]:
    if not path:
        return frozenset()
    with open(path) as handle:
        lines = [line.strip().lower() for line in handle]
    hashes = [line.removeprefix("sha256:") for line in lines if line and not line.startswith("#")]
    bad = [h for h in hashes if len(h) != 64 or any(c not in "0123456789abcdef" for c in h)]
    if bad:
        raise ValueError(f"--api-keys-file: {path}: not a sha256 hex digest: {bad[0][:12]}...")
    return frozenset(hashes)


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from kubellm.gateway.app import Gateway, GatewaySettings, create_app
    from kubellm.gateway.fallback import Thresholds

    try:
        if args.static:
            from kubellm.gateway.discovery.static import StaticConfigError, StaticDiscovery

            try:
                discovery = StaticDiscovery(args.static)
            except (StaticConfigError, OSError) as error:
                print(f"kubellm gateway: {error}", file=sys.stderr)
                return 1
        else:
            from kubellm.gateway.discovery.kubernetes import KubernetesDiscovery

            from kubellm import kube

            discovery = KubernetesDiscovery(kube.load(), namespace=args.namespace)
        settings = GatewaySettings(
            max_body_bytes=args.max_body_bytes,
            api_key_hashes=_api_key_hashes(args.api_keys_file),
            thresholds=Thresholds(args.max_waiting, args.max_kv_usage, args.max_in_flight),
            max_queue=args.max_queue,
            zero_replica_wait_seconds=args.zero_replica_wait,
            scrape_interval=args.scrape_interval,
        )
    except (ValueError, OSError, KeyError) as error:
        print(f"kubellm gateway: {error}", file=sys.stderr)
        return 1
    app = create_app(Gateway(discovery, settings))
    tune_gc()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def tune_gc() -> None:
    """Set the cyclic garbage collector up for a process that serves the gateway; call it
    once the app exists, before serving."""
    # What exists now (modules, the app) lives as long as the process: keep it out of the
    # cyclic GC's full collections, whose pauses otherwise land on requests in flight.
    gc.collect()
    gc.freeze()
    # A finished request leaves no reference cycle (all of it is freed by reference
    # counting), so a young collection finds almost nothing to free: it walks the objects
    # of the requests in flight (~100 per stream) and stalls them all. At 700 that is about
    # once a second at 100 streams (~2.4 ms each); at YOUNG_COLLECTION_EVERY, once every
    # 5-20 s (~5 ms each): fewer requests in flight meet a pause.
    gc.set_threshold(YOUNG_COLLECTION_EVERY, *gc.get_threshold()[1:])


def main(argv: list[str] | None = None) -> int:
    """`python -m kubellm.gateway.cli`: the same as `kubellm gateway`."""
    parser = argparse.ArgumentParser(prog="kubellm gateway", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
