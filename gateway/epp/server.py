"""The endpoint picker's servers: ext_proc over gRPC (with the gRPC health services the
protocol names) and `/metrics` over HTTP.

One ext_proc stream carries one HTTP exchange. `Exchange` follows it and translates its
messages into calls on the request's ticket (`routing.lifecycle`), which holds every
routing state and the SLO outcome (the same calls the HTTP gateway makes):

- request headers, then the body (full-duplex: buffered here until the end; buffered
  mode: one message) -> parse the OpenAI request, `admit` it through the routing core,
  `ticket.attempt` the first replica and answer with the picked endpoints (or an
  OpenAI-format error as an immediate response: 400 bad body, 404 unknown model, 413 too
  large, the core's 429/503 with Retry-After);
- response headers -> `attempt.started` / `attempt.failed` (a replica's 5xx is answered
  with the core's 502), `ticket.respond`; then, where Envoy's modes allow a mode override
  (neither body mode FULL_DUPLEX_STREAMED) and the core needs no more of the answer
  (`ticket.body_needed`: a non-streamed answer within its TTFT target, no tenant, not the
  fallback), the exchange ends there (`ticket.body_unseen`): the answer asks Envoy to send
  no response body and the picker closes the stream (Envoy relays the rest alone); else
  body chunks -> `ticket.chunk`;
- the response's end, or the stream closing early (client gone, replica died mid-stream)
  -> `finish`;
- messages out of the protocol's order close the stream with INVALID_ARGUMENT, and every
  slot the exchange held is released.

The fallback API in this mode: when admission says FALLBACK the request goes to the
fallback forwarder (`--fallback-forwarder`, a `kubellm gateway` serving the models'
fallbacks alone; it holds the API key), within the model's fallback concurrency cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from grpclib.const import Status
from grpclib.server import Server
from kubellm.gateway.discovery.base import (
    Discovery,
    ModelTarget,
    find_model,
    model_cards,
    pool_cut,
)
from kubellm.gateway.epp import messages as m
from kubellm.gateway.epp import prefill, rpc
from kubellm.gateway.epp.settings import PickerSettings
from kubellm.gateway.protocol import errors, usage
from kubellm.gateway.protocol.errors import GatewayError
from kubellm.gateway.protocol.openai import PATHS, parse_body
from kubellm.gateway.routing.canary import mirror
from kubellm.gateway.routing.disagg import DisaggMetrics
from kubellm.gateway.routing.latency import metrics as slo
from kubellm.gateway.routing.lifecycle import ROUTE_HEADER, Attempt, Ticket
from kubellm.gateway.routing.router import routing_request
from kubellm.gateway.routing.scheduler import Scheduler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kubellm.contracts import POOL_HEADER

log = logging.getLogger("kubellm.epp")

# The gRPC health services the protocol names, plus the reference EPP's probe name.
FORWARDER_TTL_SECONDS = 30.0
HEALTH_SERVICES = ("", "liveness", "readiness", m.SERVICE, "inference-extension")
SESSION_HEADER = "x-session-id"
DONE = b"data: [DONE]"
MAX_POOLS_CACHED = 64


def host_port(url: str) -> str:
    """`http://10.0.0.7:8000` -> `10.0.0.7:8000`: discovery's URLs as the protocol's form."""
    return urlsplit(url).netloc or url


class EndpointPicker:
    """The ext_proc service over one routing core (`Scheduler`)."""

    def __init__(self, discovery: Discovery, settings: PickerSettings | None = None) -> None:
        self.settings = settings or PickerSettings()
        self.scheduler = Scheduler(discovery, self.settings.scheduler)
        self.disagg = DisaggMetrics(self.scheduler.metrics.registry)  # P/D (epp/prefill.py)
        self._client: aiohttp.ClientSession | None = None
        self._forwarder: tuple[str, float] | None = None  # (ip:port, resolved at)
        self.streams = 0  # ext_proc streams open
        self.buffered = 0  # request-body bytes held by streams not yet routed
        self._seen: Mapping[str, ModelTarget] | None = None  # the snapshot `_pools` cut
        self._pools: dict[str, Mapping[str, ModelTarget]] = {}
        # the canary's shadow step: Envoy sends each request to one endpoint, so the
        # picker, which holds the body, asks the stable and canary replicas itself (the
        # gateway's mirror, bounded and counted the same way; the client never sees it)
        self.mirror = mirror.Mirror(
            mirror.metrics_for(self.metrics.registry), mirror.aiohttp_post(lambda: self._client),
            self.scheduler.load,
        )  # fmt: skip

    def models(self, pool: str | None) -> Mapping[str, ModelTarget]:
        """The models a request may reach: those of the InferencePool its route names
        (`POOL_HEADER`, `<namespace>/<name>` or `<name>`), whatever its body names; every
        model the picker serves when the route names none (a picker with `--pool-name`
        serves one pool; a shared one relies on its routes to name theirs)."""
        snapshot = self.scheduler.discovery.snapshot()
        if pool is None:
            return snapshot
        if snapshot is not self._seen:  # snapshots are immutable: cut each one once per pool
            self._seen, self._pools = snapshot, {}
        cut = self._pools.get(pool)
        if cut is not None:
            return cut
        namespace, _, name = pool.rpartition("/")
        cut = pool_cut(snapshot, name, namespace or None)
        if len(self._pools) < MAX_POOLS_CACHED:  # the header is the route's, but bounded
            self._pools[pool] = cut
        return cut

    async def forwarder(self) -> str | None:
        """The fallback forwarder as `ip:port`; a host name is resolved (every 30 s at
        most: a Service's cluster IP rarely changes). None when unset or unresolvable."""
        configured = self.settings.fallback_forwarder
        if configured is None:
            return None
        now = time.monotonic()
        if self._forwarder is not None and now - self._forwarder[1] < FORWARDER_TTL_SECONDS:
            return self._forwarder[0]
        host, _, port = configured.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host.strip("[]"), int(port), type=socket.SOCK_STREAM
            )
        except (OSError, ValueError) as error:
            log.warning("fallback forwarder %s: cannot resolve: %s", configured, error)
            return None if self._forwarder is None else self._forwarder[0]
        ip = infos[0][4][0]
        address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        self._forwarder = (address, now)
        return address

    @property
    def metrics(self) -> slo.GatewayMetrics:
        return self.scheduler.metrics

    @property
    def started(self) -> bool:
        """`start` ran: the picker has its client (for scraping and the mirror)."""
        return self._client is not None

    async def start(self) -> None:
        """Start discovery and the engine scrape loop."""
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self.scheduler.start(self._client)

    async def stop(self) -> None:
        await self.mirror.aclose()
        await self.scheduler.stop()
        if self._client is not None:
            await self._client.close()

    async def process(self, context: rpc.Call) -> None:
        """One ext_proc stream: one HTTP exchange, read and written with the call's
        `read` / `write` (rpc.py). Messages out of the protocol's order close the stream
        with INVALID_ARGUMENT; whatever ends it, every slot the exchange acquired is
        released (`Exchange.close`)."""
        settings = self.settings
        if self.streams >= settings.max_streams:
            # The client's first message is read before the refusal: a message arriving on a
            # stream the server already ended is answered with RST_STREAM, which can reach the
            # client's gRPC core beside the status and turn it into INTERNAL (issue 39.1).
            loop = asyncio.get_running_loop()
            await _read_by(context, loop.time() + min(REFUSAL_READ_S, settings.body_timeout))
            await context.abort(
                Status.RESOURCE_EXHAUSTED,
                f"the endpoint picker holds {self.streams} ext_proc streams (--max-streams)",
            )
            return
        self.streams += 1
        exchange = Exchange(self)
        violation: OutOfOrder | None = None
        deadline = asyncio.get_running_loop().time() + settings.body_timeout
        held = 0  # request-body bytes this stream holds, counted in self.buffered
        try:
            while True:
                request = (
                    await context.read() if exchange.routed else await _read_by(context, deadline)
                )
                if request is None:  # the request did not arrive whole in time
                    await context.write(exchange.refuse(errors.body_timeout(settings.body_timeout)))
                    return
                if request is rpc.EOF:
                    return
                if (
                    not exchange.routed
                    and request.HasField("request_body")
                    and self.buffered + len(request.request_body.body) > settings.max_buffered_bytes
                ):
                    full = buffer_full(
                        settings.max_buffered_bytes, self.scheduler.settings.retry_after_seconds
                    )
                    answers: list[Any] = [exchange.refuse(full)]
                else:
                    try:
                        answers = await exchange.handle(request)
                    except OutOfOrder as error:
                        violation = error
                        break
                    except Exception:  # a bug here must not hang the client's request
                        log.exception("ext_proc message failed")
                        answers = [exchange.refuse(
                            errors.GatewayError(500, "The endpoint picker failed.", "server_error")
                        )]  # fmt: skip
                size = 0 if exchange.routed else len(exchange.body)
                if exchange.routed and exchange.body:
                    exchange.body = bytearray()  # routed or refused: the body is not needed
                self.buffered += size - held
                held = size
                for answer in answers:
                    await context.write(answer)
                if exchange.over:
                    return
        finally:
            self.buffered -= held
            self.streams -= 1
            exchange.close()
        if violation is not None:
            log.warning("ext_proc stream closed: %s", violation)
            await context.abort(Status.INVALID_ARGUMENT, str(violation))


class OutOfOrder(Exception):
    """An ext_proc message the protocol does not allow at this point of the exchange."""


# Which messages may come in each phase of an exchange (Envoy's order: request headers
# once, the body and trailers, then the response's headers, body and trailers).
# A response may come before the request was routed: a local reply Envoy made itself (the
# buffer filter's 413 for a body over the bound reaches ext_proc's encode side without any
# request message). It is passed on; nothing was acquired for it.
_ALLOWED = {
    "start": frozenset({"request_headers", "response_headers"}),
    "body": frozenset({"request_body", "request_trailers", "response_headers"}),
    "routed": frozenset({"request_body", "request_trailers", "response_headers"}),
    "response": frozenset({"response_body", "response_trailers"}),
    "ended": frozenset({"response_trailers"}),
}


REFUSAL_READ_S = 1.0  # how long a stream refused at the cap may take to send its first message


async def _read_by(context: Any, deadline: float) -> Any:
    """The stream's next message, or None once `deadline` (loop time) has passed."""
    if deadline <= asyncio.get_running_loop().time():
        return None
    if context.ready():  # a whole message is there: the read cannot wait, no timer needed
        return await context.read()
    try:  # one timer, no task around the read
        async with asyncio.timeout_at(deadline):
            return await context.read()
    except TimeoutError:
        return None


def buffer_full(limit: int, retry_after: int) -> GatewayError:
    return GatewayError(
        503,
        f"The endpoint picker holds its limit of request bodies ({limit} bytes, "
        f"--max-buffered-bytes); retry after {retry_after} s.",
        "server_error",
        "service_unavailable",
        headers={"Retry-After": str(retry_after)},
    )


class Exchange:
    """One HTTP exchange while Envoy streams it through: ext_proc messages translated into
    calls on the request's ticket (`routing.lifecycle`), which holds every routing state."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.sched = picker.scheduler
        self.request_mode: m.BodyMode = m.BUFFERED
        self.response_mode: m.BodyMode = m.NONE
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.body = bytearray()
        self.phase = "start"
        self.arrived = time.monotonic()
        self.ticket: Ticket | None = None
        self.attempt: Attempt | None = None  # the replica the request was sent to
        self.done_seen = False  # the stream's `data: [DONE]` went by: the answer is whole
        # a tenant's stream whose replica was asked for the usage its client did not ask
        # for: the usage event is taken out of the answer's body (`_response_body`)
        self.strip: usage.UsageStrip | None = None
        self.rewritten = False  # the body sent upstream is not the client's (`_route`)
        self.over = False  # nothing more to read: the picker ends the stream (`process`)

    @property
    def routed(self) -> bool:
        """The request was routed or refused: its body is no longer needed, and the
        stream's body deadline no longer applies."""
        return self.phase not in ("start", "body")

    @property
    def url(self) -> str | None:
        """The replica the request went to (None: none)."""
        return None if self.attempt is None else self.attempt.url

    # ------------------------------------------------------------------ messages

    async def handle(self, request: m.ProcessingRequest) -> list[m.ProcessingResponse | bytes]:
        modes = m.body_modes(request)
        if modes is not None:
            self.request_mode, self.response_mode = modes
        kind = m.kind(request)
        if kind not in _ALLOWED[self.phase]:
            if kind not in _KINDS:
                return []
            raise OutOfOrder(f"ext_proc message {kind} is out of order ({self.phase})")
        if kind == "request_headers":
            return await self._request_headers(request)
        if kind == "request_body":
            return await self._request_body(request)
        if kind == "request_trailers":
            answers: list[m.ProcessingResponse | bytes] = []
            if self.phase == "body":
                answers += await self._route(bytes(self.body), "request_headers")
                if self.phase != "ended" and self.request_mode == m.FULL_DUPLEX:
                    answers += m.body_pieces(bytes(self.body))
            return [*answers, m.CONTINUE_REQUEST_TRAILERS]
        if kind == "response_headers":
            return self._response_headers(request)
        if kind == "response_body":
            return self._response_body(request)
        self.finish()  # response trailers
        return [m.CONTINUE_RESPONSE_TRAILERS]

    async def _request_headers(self, request: m.ProcessingRequest) -> list[Any]:
        http = request.request_headers
        assert http is not None
        self.arrived = time.monotonic()
        self.headers = m.headers(http)
        self.subset = m.subset(request)
        self.phase = "body"
        if http.end_of_stream:  # no body: route now
            return await self._route(b"", "request_headers")
        if self.request_mode == m.FULL_DUPLEX:
            return []  # answered once the whole body is here
        if self.request_mode == m.STREAMED:
            return [self.refuse(GatewayError(
                500,
                "The endpoint picker needs the request body mode FULL_DUPLEX_STREAMED or "
                "BUFFERED in the gateway's ext_proc configuration (it is STREAMED).",
                "server_error",
            ))]  # fmt: skip
        return [m.CONTINUE_REQUEST_HEADERS]

    async def _request_body(self, request: m.ProcessingRequest) -> list[Any]:
        http = request.request_body
        assert http is not None
        if self.phase == "routed":  # a body after the answer (should not happen): pass it on
            return [m.CONTINUE_REQUEST_BODY]
        self.body += http.body
        limit = self.picker.settings.max_body_bytes
        if len(self.body) > limit:
            return [self.refuse(errors.too_large(limit))]
        if not http.end_of_stream:
            return [] if self.request_mode == m.FULL_DUPLEX else [m.CONTINUE_REQUEST_BODY]
        body = bytes(self.body)
        if self.request_mode == m.FULL_DUPLEX:
            answers = await self._route(body, "request_headers")
            if self.phase != "ended":
                answers += m.body_pieces(bytes(self.body))  # a split's decode leg: its own
            return answers
        return await self._route(body, "request_body")

    def _response_headers(self, request: m.ProcessingRequest) -> list[Any]:
        http = request.response_headers
        assert http is not None
        self.phase = "response"
        values = m.headers(http)
        try:
            status = int(values.get(":status", "0"))
        except ValueError:
            status = 0
        ticket, attempt = self.ticket, self.attempt
        if ticket is not None:
            if attempt is not None:
                served = m.filter_metadata(
                    request, self.picker.settings.metadata_namespace, m.SERVED
                )
                if isinstance(served, str) and host_port(attempt.url) != served:
                    attempt = self._moved_to(ticket, served) or attempt
                if status >= 500:  # the core's 502 in place of the replica's error
                    attempt.failed()
                    return [self._immediate(ticket.attempts_failed(1))]
                attempt.started()
            ticket.respond(status)
        if status != 200:
            self.strip = None  # an error's body is passed on as the replica sent it
        if http.end_of_stream:
            self.finish()
            return [m.CONTINUE_RESPONSE_HEADERS]
        if self.response_mode in _OVERRIDABLE and self.request_mode in _OVERRIDABLE:
            now = time.monotonic()
            if ticket is None or not ticket.body_needed(now):
                # nothing more to learn from this exchange: it ends here, and the picker
                # ends the ext_proc stream after this answer (Envoy takes a server's close
                # as "processing complete" and relays the rest alone: one message and a
                # thread hop each side fewer per request than waiting for Envoy's close);
                # the override also tells Envoy to send no body should the close lag
                self.response_mode = m.NONE
                if ticket is not None:  # (Envoy's own local reply: Envoy closes the stream)
                    ticket.body_unseen(now)
                    self.finish()
                    self.over = True
                return [m.skip_response_body(self.request_mode)]
        if self.strip is not None:  # the body will be shorter than the replica's
            return [m.CONTINUE_RESPONSE_HEADERS_UNSIZED]
        return [m.CONTINUE_RESPONSE_HEADERS]

    def _response_body(self, request: m.ProcessingRequest) -> list[Any]:
        http = request.response_body
        assert http is not None
        if self.ticket is not None and http.body:
            self.ticket.chunk(http.body)
        if DONE in http.body:
            self.done_seen = True
        if http.end_of_stream:
            self.finish()
        strip = self.strip
        if strip is not None:  # the usage event the client did not ask for is taken out
            data = strip.feed(http.body) if http.body else b""
            if http.end_of_stream:
                data += strip.end()
            if self.response_mode == m.FULL_DUPLEX:
                return [m.echo_chunk(data, http.end_of_stream)]
            return [m.CONTINUE_RESPONSE_BODY if data == http.body else m.replace_chunk(data)]
        if self.response_mode == m.FULL_DUPLEX:
            return [m.echo_chunk(http.body, http.end_of_stream)]
        return [m.CONTINUE_RESPONSE_BODY]

    # ------------------------------------------------------------------ routing

    def refuse(self, error: GatewayError) -> m.ProcessingResponse:
        """An OpenAI-format error, answered by Envoy without going upstream: the ticket's
        outcome when there is one, else counted as a request refused before a model."""
        if self.ticket is not None:
            self.ticket.fail(error)
        else:
            self.sched.metrics.refused(error.status)
        return self._immediate(error)

    def _immediate(self, error: GatewayError) -> m.ProcessingResponse:
        self.phase = "ended"  # nothing more to decide
        return m.immediate(error.status, error.body(), error.headers, details=error.code or "")

    async def _route(self, body: bytes, phase: str) -> list[Any]:
        path = self.headers.get(":path", "").split("?", 1)[0]
        parsed: dict[str, Any] = {}
        try:
            if path in PATHS:
                parsed = parse_body(body, path)
            elif body:
                with contextlib.suppress(ValueError):
                    loaded = json.loads(body)
                    parsed = loaded if isinstance(loaded, dict) else {}
        except GatewayError as error:
            return [self.refuse(error)]
        models = self.picker.models(self.headers.get(POOL_HEADER))
        found = parsed.get("model")
        model = found if isinstance(found, str) and found else None
        if model is None:
            return [self._no_model(path, models)]
        match = find_model(models, model)  # a model or a LoRA adapter, of the route's pool
        if match is None:
            return [self.refuse(errors.model_not_found(model))]
        target, adapter = match
        try:  # the tenant, from the headers Envoy passes (tenancy.py), when declared
            caller = self.sched.flow.identify(self.headers)
        except GatewayError as error:
            return [self.refuse(error)]
        session = self.headers.get(SESSION_HEADER)
        routing = routing_request(target.served_name, parsed, session, adapter)
        settings = self.picker.settings
        ticket = self.ticket = await self.sched.admit(
            target,
            routing,
            arrived=self.arrived,
            stream=parsed.get("stream") is True,
            fallback=settings.fallback_forwarder is not None,
            caller=caller,
        )
        if ticket.refusal is not None:
            return [self._immediate(ticket.refusal)]
        if self._asks_usage(ticket, path, parsed):  # settled on the replica's own figures
            body = json.dumps(usage.asking_usage(parsed), ensure_ascii=False).encode()
            self.body = bytearray(body)  # full-duplex mode sends it back (`body_pieces`)
            self.strip, self.rewritten = usage.UsageStrip(), True
        if ticket.route == "fallback":
            forwarder = await self.picker.forwarder()
            if forwarder is None:
                retry = self.sched.settings.retry_after_seconds
                return [self.refuse(errors.overloaded(model, retry, 503))]
            extra = {"x-kubellm-fallback-reason": ticket.reason}
            return [self._answer(phase, [forwarder], body, ticket.route, extra)]
        allowed = self.subset
        urls = ticket.urls(None if allowed is None else lambda url: host_port(url) in allowed)
        if not urls:
            return [self.refuse(GatewayError(
                503, f"No endpoint of model `{model}` is in the gateway's endpoint subset.",
                "server_error", "service_unavailable",
            ))]  # fmt: skip
        if ticket.target.prefill is not None and self.request_mode in _REWRITABLE:
            assert self.picker._client is not None
            body = await prefill.split(
                self.sched, self.picker.disagg, self.picker._client, ticket, urls[0],
                path, parsed, body,
            )  # fmt: skip
            self.body, self.rewritten = bytearray(body), True  # the decode leg's, to Envoy
            urls = urls[:1]  # Envoy's retry on another replica would lose the KV's params
        self.attempt = ticket.attempt(urls[0])
        if path in PATHS and self.picker.started:
            self.picker.mirror.offer(target, urls[0], path, parsed, routing.prompt_chars, ticket)
        listed = [host_port(u) for u in urls[: settings.endpoints_per_answer]]
        return [self._answer(phase, listed, body, ticket.route)]

    def _asks_usage(self, ticket: Ticket, path: str, parsed: dict[str, Any]) -> bool:
        """A tenant's stream is settled (usage, quotas, the fair budget) on the replica's
        usage: asked for here (a body mutation) where the client did not ask, in the body
        modes where the picker can both rewrite the request and take the event out of the
        answer. Other requests' bodies go through untouched (no usage is settled on them)."""
        return (
            ticket.stream
            and ticket.caller is not None
            and path in PATHS
            and not usage.wants_usage(parsed)
            and self.request_mode in _REWRITABLE
            and self.response_mode in _REWRITABLE_ANSWER
        )

    def _no_model(self, path: str, models: Mapping[str, ModelTarget]) -> m.ProcessingResponse:
        """A request naming no model reaches no replica: `GET /v1/models` is answered here
        (the route's pool's models, as the HTTP gateway lists them), anything else is 404."""
        if self.headers.get(":method", "GET") == "GET" and path == "/v1/models":
            self.phase = "ended"
            return m.immediate(200, model_cards(models))
        return self.refuse(GatewayError(
            404,
            f"Unknown path {path}: the endpoint picker routes requests that name a model.",
            code="not_found",
        ))  # fmt: skip

    def _answer(
        self,
        phase: str,
        endpoints: list[str],
        body: bytes,
        route: str,
        extra: dict[str, str] | None = None,
    ) -> m.ProcessingResponse | bytes:
        self.phase = "routed"
        settings = self.picker.settings
        set_headers = {ROUTE_HEADER: route, **(extra or {})}
        header, namespace = settings.destination_header, settings.metadata_namespace
        if not body or not (self.rewritten or self.request_mode == m.FULL_DUPLEX):
            # the body goes on as Envoy holds it, with its own content-length: the answer
            # depends on the endpoints and the route only (built once, kept)
            return m.route_answer(phase, endpoints, set_headers, header, namespace)
        set_headers["content-length"] = str(len(body))
        rewritten = body if phase == "request_body" else None  # full duplex: body_pieces
        return m.route_response(phase, endpoints, set_headers, header, namespace, rewritten)

    def _moved_to(self, ticket: Ticket, served: str) -> Attempt | None:
        """Envoy retried on a later endpoint of the list: the request is counted there."""
        for endpoint in ticket.target.endpoints:
            if host_port(endpoint.url) == served:
                self.attempt = ticket.attempt(endpoint.url)
                return self.attempt
        return None

    # ------------------------------------------------------------------ the end

    def finish(self) -> None:
        """The response ended normally."""
        self.phase = "ended"
        if self.ticket is not None:
            self.ticket.finish()

    def close(self) -> None:
        """The ext_proc stream closed: if the response had not ended, it broke; unless
        Envoy sends no response body (mode NONE): then the close is the end."""
        ticket = self.ticket
        if ticket is not None and not ticket.done:
            if ticket.status and (self.response_mode == m.NONE or self.done_seen):
                ticket.finish()  # a client may hang up right after `[DONE]`, before the end
            else:
                ticket.finish("stream closed before the response ended")


# Body modes under which Envoy honours a mode override (not FULL_DUPLEX_STREAMED in either
# direction of the filter's configuration; Envoy 1.40, ext_proc.cc).
_OVERRIDABLE = frozenset({m.BUFFERED, m.STREAMED, m.NONE})
# Body modes in which the picker can replace the request's body (whole), and the answer's
# body chunk by chunk.
_REWRITABLE = frozenset({m.BUFFERED, m.FULL_DUPLEX})
_REWRITABLE_ANSWER = frozenset({m.BUFFERED, m.STREAMED, m.FULL_DUPLEX})
_KINDS = frozenset(kind for kinds in _ALLOWED.values() for kind in kinds)


# ---------------------------------------------------------------------------- servers


@dataclass
class Servers:
    grpc: list[Server]  # ext_proc and health on the gRPC port; health alone on its own
    health: rpc.Health
    metrics: web.AppRunner | None
    ports: dict[str, int]
    picker: EndpointPicker

    async def stop(self, grace: float = 5.0) -> None:
        """Health says NOT_SERVING; open streams get `grace` seconds to end."""
        self.health.set_all(rpc.NOT_SERVING)
        await rpc.stop(self.grpc, grace, lambda: self.picker.streams == 0)
        if self.metrics is not None:
            await self.metrics.cleanup()


async def serve(
    picker: EndpointPicker,
    host: str = "127.0.0.1",
    grpc_port: int = 9002,
    health_port: int | None = 9003,
    metrics_port: int | None = 9090,
) -> Servers:
    """Start the gRPC server (ext_proc and health on `grpc_port`, health alone on
    `health_port` too; rpc.py) and the `/metrics` HTTP server; port 0 picks a free one."""
    settings = picker.settings
    checker = rpc.Health(HEALTH_SERVICES)
    ext_proc = rpc.ExtProc(picker.process, settings.max_body_bytes + (1 << 20))
    server, port = await rpc.start([ext_proc, checker], host, grpc_port, settings.max_streams)
    servers, ports = [server], {"grpc": port}
    if health_port is not None:
        alone, ports["health"] = await rpc.start([checker], host, health_port, 16)
        servers.append(alone)
    runner = None
    if metrics_port is not None:
        runner = web.AppRunner(metrics_app(picker), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, metrics_port)
        await site.start()
        sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
        ports["metrics"] = sockets[0].getsockname()[1] if sockets else metrics_port
    return Servers(servers, checker, runner, ports, picker)


def metrics_app(picker: EndpointPicker) -> web.Application:
    async def prometheus(_: web.Request) -> web.Response:
        picker.scheduler.update_ready_gauge()
        body = generate_latest(picker.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthy(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/health", healthy)
    return app
