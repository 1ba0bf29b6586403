"""`kubellm gateway`: run the OpenAI-compatible gateway.

    kubellm gateway --port 8080 --static examples/gateway-static.yaml
    kubellm gateway --port 8080            # watch LLMDeployments and EndpointSlices

Imports stay light here; the app is built inside `run`.
"""

from __future__ import annotations

import argparse
import gc
import sys

from kubellm.gateway.http.settings import ClientLimits, GatewaySettings
from kubellm.gateway.routing import flags

_D, _CLIENT = GatewaySettings(), ClientLimits()  # each default stated once, there

# The cyclic GC's young-generation threshold in the gateway process (Python's default: 700).
YOUNG_COLLECTION_EVERY = 20_000


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument(
        "--api-keys-file",
        metavar="FILE",
        help="require an API key: FILE holds sha256 hex digests of accepted keys, one a line",
    )
    parser.add_argument("--max-body-bytes", type=int, default=_D.max_body_bytes)
    flags.add_arguments(parser)  # admission, scraping, tokenizers, LoRA, discovery: as the EPP
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics on this port only, not on --port (keep it off the public listener)",
    )
    parser.add_argument("--log-level", default="warning")
    up = parser.add_argument_group(
        "toward replicas and the fallback API (a model's spec.routing.timeouts overrides each)"
    )
    up.add_argument(
        "--connect-timeout", type=float, default=_D.connect_timeout, help="opening a connection"
    )
    up.add_argument(
        "--first-byte-timeout",
        type=float,
        default=_D.first_byte_timeout,
        help="an answer's first body byte; past it, retry on another replica and eject this "
        "one, unless the replica's scraped token counters still move (a queued engine at work; "
        "default: 5 x the model's TTFT target, at least 10 s)",
    )
    up.add_argument(
        "--idle-timeout",
        type=float,
        default=_D.idle_timeout,
        help="the longest silence within a stream",
    )
    up.add_argument(
        "--total-timeout",
        type=float,
        default=_D.total_timeout,
        help="a whole request, retries included",
    )
    up.add_argument(
        "--max-response-bytes",
        type=int,
        default=_D.max_response_bytes,
        help="a non-streamed answer, held whole (or assembled) before it is sent on",
    )
    up.add_argument(
        "--assemble-non-streamed",
        action=argparse.BooleanOptionalAction,
        default=_D.assemble_non_streamed,
        help="default (neither flag): a non-streamed request goes whole to a replica whose "
        "scraped token counters are fresh (a stall found by them standing still), as a stream "
        "assembled here to any other (a stall found between its pieces); "
        "--assemble-non-streamed: as streams to every replica (~1.45x the CPU); "
        "--no-assemble-non-streamed: whole to every replica (a replica without the counters: "
        "--total-timeout only)",
    )
    up.add_argument(
        "--max-upstream-head-bytes",
        type=int,
        default=_D.max_upstream_head_bytes,
        help="an answer's status line and headers",
    )
    client = parser.add_argument_group("from clients")
    client.add_argument(
        "--header-timeout",
        type=float,
        default=_CLIENT.header_timeout,
        help="a request's line and headers",
    )
    client.add_argument(
        "--body-timeout",
        type=float,
        default=_D.body_timeout,
        help="a request's body, after its headers",
    )
    client.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=_CLIENT.keep_alive_timeout,
        help="an idle kept-alive connection",
    )
    client.add_argument(
        "--max-connections",
        type=int,
        default=_CLIENT.max_connections,
        help="open client connections; over it, a 503 and close (0: half the descriptor limit)",
    )


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
    import asyncio

    import uvicorn
    from kubellm.gateway.http import server
    from kubellm.gateway.http.app import Gateway, create_app, create_metrics_app
    from kubellm.gateway.routing.latency import metrics as slo

    metrics = slo.create()
    try:
        from kubellm.gateway.discovery.static import StaticConfigError

        try:
            discovery = flags.discovery(args, on_reload_error=metrics.config_reload_errors.inc)
        except (StaticConfigError, OSError) as error:
            print(f"kubellm gateway: {error}", file=sys.stderr)
            return 1
        settings = settings_from(args)
    except (ValueError, OSError, KeyError) as error:
        print(f"kubellm gateway: {error}", file=sys.stderr)
        return 1
    gateway = Gateway(discovery, settings, metrics=metrics)
    separate = args.metrics_port is not None
    limits = server.ClientLimits(
        header_timeout=args.header_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections,
    )
    refused = metrics.connections_refused.inc
    servers = [
        uvicorn.Server(
            server.config(
                create_app(gateway, metrics_route=not separate), limits, refused,
                host=args.host, port=args.port, log_level=args.log_level,
            )
        )
    ]  # fmt: skip
    if separate:
        servers.append(
            uvicorn.Server(
                server.config(
                    create_metrics_app(gateway), limits, refused,
                    host=args.host, port=args.metrics_port, log_level=args.log_level,
                    lifespan="off",
                )
            )
        )  # fmt: skip
    tune_gc()
    with asyncio.Runner(loop_factory=server.event_loop_factory()) as runner:
        runner.run(server.serve([(s, None) for s in servers]))
    return 0


def settings_from(args: argparse.Namespace) -> GatewaySettings:
    """The gateway's settings from its command line: the routing core's (shared with
    `kubellm epp`) and the HTTP front end's own."""
    return GatewaySettings(
        scheduler=flags.settings_from(args),
        max_body_bytes=args.max_body_bytes,
        api_key_hashes=_api_key_hashes(args.api_keys_file),
        connect_timeout=args.connect_timeout,
        first_byte_timeout=args.first_byte_timeout,
        idle_timeout=args.idle_timeout,
        total_timeout=args.total_timeout,
        max_response_bytes=args.max_response_bytes,
        assemble_non_streamed=args.assemble_non_streamed,
        max_upstream_head_bytes=args.max_upstream_head_bytes,
        body_timeout=args.body_timeout,
    )


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
