"""The floor of the Inference Extension's path on the picker's own transport (--peers
envoy+epp-floor, --instructions-paths envoy+epp-floor): the picker's gRPC server
(`gateway/epp/rpc.py`: grpclib, the lean ext_proc handler, the remembering coders, one
send per loop turn) answering every ext_proc stream with a fixed route, as the picker
answers a routed non-streamed request in BUFFERED mode (request headers continued, the
body answered with the first endpoint, the response headers continued with the response
body skipped, the stream closed by the picker). No admission, no routing, no parsing of
the body, no metrics: what any picker on this transport costs per request before it
decides anything.

Takes the same flags as `kubellm epp` where the bench passes them (`--static` for the
endpoint, `--host`, `--grpc-port`, `--grpc-health-port` (ignored), `--metrics-port` for
`/health`, `--log-level`); the rest of `kubellm epp`'s flags are accepted and ignored.

    python bench/gateway/_proxy/epp_floor.py --static FILE --grpc-port N --metrics-port M
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from urllib.parse import urlsplit

import yaml
from aiohttp import web
from kubellm.gateway.epp import messages as m
from kubellm.gateway.epp import rpc
from kubellm.gateway.epp.settings import PickerSettings
from kubellm.gateway.routing.lifecycle import ROUTE_HEADER


def answers(endpoint: str) -> dict[str, bytes]:
    """The picker's answers to a routed BUFFERED exchange, by the message they answer."""
    settings = PickerSettings()
    return {
        "request_headers": m.CONTINUE_REQUEST_HEADERS,
        "request_body": m.route_answer(
            "request_body",
            [endpoint],
            {ROUTE_HEADER: "floor"},
            settings.destination_header,
            settings.metadata_namespace,
        ),
        "response_headers": m.skip_response_body(m.BUFFERED),
    }


def fixed(endpoint: str, max_message: int) -> rpc.ExtProc:
    table = answers(endpoint)
    last = "response_headers"

    async def process(call: rpc.Call) -> None:
        for _ in range(16):  # bounded: a BUFFERED exchange is three messages
            request = await call.read()
            if request is rpc.EOF:
                return
            kind = m.kind(request)
            answer = table.get(kind)
            if answer is None:
                answer = (
                    m.CONTINUE_RESPONSE_BODY
                    if kind == "response_body"
                    else (m.CONTINUE_RESPONSE_TRAILERS)
                )
            await call.write(answer)
            if kind == last:
                return  # the picker closes the stream, as after `skip_response_body`

    return rpc.ExtProc(process, max_message)


async def serve(args: argparse.Namespace) -> None:
    with open(args.static) as handle:
        url = yaml.safe_load(handle)["models"][0]["endpoints"][0]
    endpoint = urlsplit(url).netloc or url
    settings = PickerSettings()
    ext_proc = fixed(endpoint, settings.max_body_bytes + (1 << 20))
    health = rpc.Health(("",))
    server, _ = await rpc.start([ext_proc, health], args.host, args.grpc_port, settings.max_streams)
    app = web.Application()
    app.router.add_get("/health", lambda _: web.Response(text="ok"))  # type: ignore[arg-type, return-value]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.metrics_port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"epp floor: serving ext_proc on {args.host}:{args.grpc_port}", flush=True)
    try:
        await stop.wait()
    finally:
        await rpc.stop([server], 1.0, lambda: True)
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--static", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--log-level", default="warning")
    args, _ = parser.parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    from kubellm.gateway.epp.cli import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
