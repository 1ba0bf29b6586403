"""`kubellm epp`: run the endpoint picker for Envoy-based gateways (Gateway API
Inference Extension).

    kubellm epp --static examples/gateway-static.yaml      # models from a file
    kubellm epp --namespace llm                            # watch LLMDeployments

The gateway's Envoy calls it over ext_proc gRPC on --grpc-port; gRPC health on
--grpc-port and --grpc-health-port; Prometheus metrics on --metrics-port /metrics.
Imports stay light here; the servers are built inside `run`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable

from kubellm.gateway.epp.settings import PickerSettings
from kubellm.gateway.routing import flags

from kubellm.event_loop import loop_factory

_D = PickerSettings()


def _endpoint(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port")
    parser.add_argument(
        "--grpc-health-port", type=int, default=9003, help="gRPC health port (0: pick one)"
    )
    parser.add_argument("--metrics-port", type=int, default=9090, help="HTTP /metrics port")
    parser.add_argument(
        "--pool-name",
        metavar="NAME",
        help="serve this one InferencePool, as the Inference Extension's picker does: only "
        "its model's endpoints are picked, a request naming another pool's model is 404 "
        "(the operator names a pool <LLMDeployment>-engine; a static file's model takes "
        "`pool`). Without it the picker serves every model it watches: one pool only then",
    )
    parser.add_argument(
        "--pool-namespace",
        metavar="NAMESPACE",
        help="the pool's namespace (default: --namespace, else any)",
    )
    parser.add_argument(
        "--fallback-forwarder",
        metavar="HOST:PORT",
        type=_endpoint,
        help="where overflow goes when admission picks the fallback API: the fallback "
        "forwarder Service (a `kubellm gateway` that holds the API key); without it, "
        "overflow gets 429/503",
    )
    parser.add_argument(
        "--endpoints-per-answer",
        type=int,
        default=_D.endpoints_per_answer,
        help="endpoints listed per answer, best first, for gateways that retry down the "
        "list (Envoy's ORIGINAL_DST cluster, as in the reference configuration, reads one)",
    )
    parser.add_argument(
        "--destination-header",
        default=_D.destination_header,
        help="the header (and metadata key) that carries the picked endpoints",
    )
    parser.add_argument(
        "--metadata-namespace",
        default=_D.metadata_namespace,
        help="the dynamic-metadata namespace of the picked endpoints",
    )
    parser.add_argument("--max-body-bytes", type=int, default=_D.max_body_bytes)
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=_D.body_timeout,
        help="seconds from an ext_proc stream's start to its whole request (else a 408)",
    )
    parser.add_argument(
        "--max-streams",
        type=int,
        default=_D.max_streams,
        help="ext_proc streams at once; more are refused with RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--max-buffered-bytes",
        type=int,
        default=_D.max_buffered_bytes,
        help="request bodies held across all streams until routed; more get a 503",
    )
    flags.add_arguments(parser)  # admission, scraping, tokenizers, LoRA, discovery: as the gateway
    parser.add_argument("--log-level", default="warning")


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop the picker serves on (kubellm.event_loop): KUBELLM_EPP_LOOP=asyncio
    forces asyncio's."""
    return loop_factory("KUBELLM_EPP_LOOP")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from kubellm.gateway.epp.server import EndpointPicker, serve

    logging.basicConfig(level=args.log_level.upper())
    for flag in (
        "max_body_bytes", "max_queue", "endpoints_per_answer", "max_streams",
        "max_buffered_bytes",
    ):  # fmt: skip
        if getattr(args, flag) < 1:
            print(f"kubellm epp: --{flag.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 1
    if not args.body_timeout > 0:
        print("kubellm epp: --body-timeout must be more than 0", file=sys.stderr)
        return 1
    try:
        from kubellm.gateway.discovery.static import StaticConfigError

        try:  # no Secret is read: overflow goes to the fallback forwarder, which holds keys
            discovery = flags.discovery(args, read_fallback_keys=False)
        except (StaticConfigError, OSError) as error:
            print(f"kubellm epp: {error}", file=sys.stderr)
            return 1
        if args.pool_name:
            from kubellm.gateway.discovery.base import PoolDiscovery

            discovery = PoolDiscovery(
                discovery, args.pool_name, args.pool_namespace or args.namespace
            )
        settings = PickerSettings(
            max_body_bytes=args.max_body_bytes,
            body_timeout=args.body_timeout,
            max_streams=args.max_streams,
            max_buffered_bytes=args.max_buffered_bytes,
            destination_header=args.destination_header,
            metadata_namespace=args.metadata_namespace,
            fallback_forwarder=args.fallback_forwarder,
            endpoints_per_answer=args.endpoints_per_answer,
            scheduler=flags.settings_from(args),
        )
    except (ValueError, OSError, KeyError) as error:
        print(f"kubellm epp: {error}", file=sys.stderr)
        return 1

    async def main() -> None:
        picker = EndpointPicker(discovery, settings)
        await picker.start()
        servers = await serve(
            picker, args.host, args.grpc_port, args.grpc_health_port, args.metrics_port
        )
        print(f"kubellm epp: serving ext_proc on {args.host}:{servers.ports['grpc']}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        try:
            await stop.wait()
        finally:
            await servers.stop()
            await picker.stop()

    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(main())
    except (OSError, RuntimeError) as error:  # grpc: "Failed to bind to address ..."
        print(f"kubellm epp: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kubellm.gateway.epp.cli`: the same as `kubellm epp`."""
    parser = argparse.ArgumentParser(prog="kubellm epp", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
