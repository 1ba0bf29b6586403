"""The HTTP front end: one OpenAI-compatible endpoint in front of a fleet.

Per request: authenticate, read the body within its size and time limits, parse and
check it (`protocol.openai`), find the model, then the routing core decides before any
byte is sent (`Scheduler.admit`, which returns the request's ticket,
`routing.lifecycle`): replica, fallback, queue or the core's refusal. Replica requests
are forwarded best candidate first with retries until a replica gives its first byte
(`relay.open_upstream`, each try a `ticket.attempt`), then relayed (streams chunk by
chunk, each through `ticket.chunk`); a non-streamed request goes to the replica as a
stream and its answer is assembled (`protocol.assemble`) before anything is sent, so the
same timeouts, a stall rule and the retries bound it (`relay`); `ticket.finish` counts the
outcome once, whatever ends the request. What this module keeps is HTTP: ASGI messages,
headers, bodies, the envelopes the core's errors are rendered in; anything unexpected is
a 500 in OpenAI's envelope with a request id, logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from kubellm.gateway.discovery.base import (
    Discovery,
    FallbackTarget,
    ModelTarget,
    find_model,
    model_cards,
)
from kubellm.gateway.http import prefill, relay, server, upstream
from kubellm.gateway.http.relay import AiohttpResponse, AnyResponse, Forward
from kubellm.gateway.http.settings import GatewaySettings
from kubellm.gateway.protocol import errors, usage
from kubellm.gateway.protocol.errors import GatewayError
from kubellm.gateway.protocol.openai import CHAT, COMPLETIONS, parse_body
from kubellm.gateway.routing.canary import mirror
from kubellm.gateway.routing.disagg import DisaggMetrics
from kubellm.gateway.routing.flow.controller import Caller
from kubellm.gateway.routing.flow.tenants import TENANT_HEADERS
from kubellm.gateway.routing.latency import metrics as slo
from kubellm.gateway.routing.lifecycle import ROUTE_HEADER, Ticket
from kubellm.gateway.routing.replicas.load import LoadView
from kubellm.gateway.routing.router import routing_request
from kubellm.gateway.routing.scheduler import Scheduler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute
from starlette.types import Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

__all__ = ["CHAT", "COMPLETIONS", "Gateway", "GatewaySettings", "create_app", "parse_body"]

log = logging.getLogger("kubellm.gateway")
FORWARDED = relay.FORWARDED_HEADERS


def hash_key(key: str) -> str:
    """How API keys are stored in configuration: sha256 hex of the key."""
    return hashlib.sha256(key.encode()).hexdigest()


class Gateway:
    """The HTTP front end of one process, over its routing core (`scheduler`)."""

    def __init__(
        self,
        discovery: Discovery,
        settings: GatewaySettings | None = None,
        client: aiohttp.ClientSession | None = None,
        metrics: slo.GatewayMetrics | None = None,
    ) -> None:
        self.discovery = discovery
        self.settings = s = settings or GatewaySettings()
        self.scheduler = Scheduler(discovery, s.scheduler, metrics)
        self.metrics = self.scheduler.metrics
        self._client = client  # https replicas', the fallback API's and scraping's client
        self._replicas: upstream.Pool | None = None  # the plain-http replicas' client
        self.disagg = DisaggMetrics(self.metrics.registry)  # P/D splits (http/prefill.py)
        self.pace = relay.Pace()  # replicas' gaps within whole answers: what a stall is
        # which replicas get a non-streamed request as a stream (`_whole`)
        mode = s.assemble_non_streamed
        self._streams = relay.always if mode else None if mode is False else self._uncounted
        # the canary's shadow step (routing/canary/mirror.py)
        self.mirror = mirror.Mirror(
            mirror.metrics_for(self.metrics.registry), mirror.aiohttp_post(lambda: self.client),
            self.scheduler.load,
        )  # fmt: skip

    @property
    def load(self) -> LoadView:
        return self.scheduler.load

    # ---------------------------------------------------------------- lifecycle

    @property
    def client(self) -> aiohttp.ClientSession:
        if self._client is None:
            s = self.settings
            self._client = relay.new_session(s.connect_timeout, s.idle_timeout)
        return self._client

    @property
    def replicas(self) -> upstream.Pool:
        """The client for engine replicas (plain http): keep-alive, framed by llhttp."""
        if self._replicas is None:
            s = self.settings
            self._replicas = upstream.Pool(s.connect_timeout, limits=s.limits())
        return self._replicas

    async def start(self) -> None:
        self.scheduler.start(self.client)

    async def stop(self) -> None:
        await self.mirror.aclose()
        await self.scheduler.stop()
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._replicas is not None:
            await self._replicas.close()
            self._replicas = None

    # ---------------------------------------------------------------- checks

    def authenticate(
        self, authorization: str | None, headers: dict[str, str] | None = None
    ) -> Caller | None:
        """Check the `Authorization` header's value (None: absent) against the key hashes,
        or find its tenant from the request's `headers` when tenants are declared."""
        if self.scheduler.tenancy is not None:
            return self.scheduler.flow.identify(headers or {"authorization": authorization or ""})
        if not self.settings.api_key_hashes:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or hash_key(key.strip()) not in self.settings.api_key_hashes:
            raise errors.unauthorized()
        return None

    async def read_body(
        self, receive: Receive, declared: str | None, buffered: Callable[[], bool] | None = None
    ) -> bytes:
        """The request body, refused once it exceeds the size limit (`declared`: its
        content-length) or takes longer than `body_timeout` to arrive (408). `buffered`
        (the server's `BODY_BUFFERED`) true: the whole body is read already, so `receive`
        answers at once and no deadline is armed."""
        limit = self.settings.max_body_bytes
        if declared and declared.isdigit() and int(declared) > limit:
            raise errors.too_large(limit)
        if buffered is not None and buffered():
            return await _receive_body(receive, limit)
        try:
            with _Deadline(self.settings.body_timeout):
                return await _receive_body(receive, limit)
        except TimeoutError:
            raise errors.body_timeout(self.settings.body_timeout) from None

    # ---------------------------------------------------------------- handlers

    async def serve(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        """POST `path` (CHAT or COMPLETIONS), as a raw ASGI handler.

        Served without Starlette's request and response objects: a stream in flight
        holds few objects, and none in a reference cycle, so it costs the cyclic
        garbage collector little (its pauses land on every stream in flight).
        The request's routing state is its ticket's (`routing.lifecycle`); this
        translates HTTP into the ticket's calls and renders what the core decides.
        """
        arrived = time.monotonic()
        headers = _wanted_headers(scope["headers"])
        extensions = scope.get("extensions") or {}  # the gateway's server's (`http/server.py`)
        call = _Call(path, headers, send, extensions.get(server.SEND_WHOLE))
        try:
            try:
                caller = self.authenticate(headers.get("authorization"), headers)
                raw = await self.read_body(
                    receive, headers.get("content-length"), extensions.get(server.BODY_BUFFERED)
                )
                body = parse_body(raw, path)
            except GatewayError as error:
                return await self._refused(error)(scope, receive, send)
            except ClientDisconnect:
                return await Response(status_code=499)(scope, receive, send)
            model = body["model"]
            found = find_model(self.discovery.snapshot(), model)  # a model or a LoRA adapter
            if found is None:
                return await self._refused(errors.model_not_found(model))(scope, receive, send)
            # Until the answer is sent, a client that leaves cancels the work: the upstream
            # request is closed (its response is closed in `finally` blocks), so an engine
            # stops working for a client that left, queued, waiting or mid-stream.
            try:
                lost = extensions.get(server.CONNECTION_LOST)
                async with relay.DisconnectWatch(receive, lost) as watch:
                    await self._route(call, found[0], found[1], raw, body, arrived, caller)
            finally:
                if call.ticket is not None:
                    call.ticket.finish()  # once: a no-op after a normal end; else 499
            if watch.disconnected and not call.started:
                await Response(status_code=499)(scope, receive, send)
        except Exception:
            request_id = _request_id(headers)
            log.exception("request %s failed with an unexpected error", request_id)
            error = errors.internal(request_id)
            if call.ticket is not None and not call.ticket.done:
                call.ticket.fail(error)
            elif call.ticket is None:
                self.scheduler.metrics.refused(error.status)
            if not call.started:
                with contextlib.suppress(Exception):
                    await error.response()(scope, receive, send)

    async def _route(
        self,
        call: _Call,
        target: ModelTarget,
        adapter: str | None,
        raw: bytes,
        body: dict[str, Any],
        arrived: float,
        caller: Caller | None = None,
    ) -> None:
        """Admission, then forwarding to a replica or the fallback, or the core's refusal."""
        routing = routing_request(
            target.served_name, body, call.headers.get("x-session-id"), adapter
        )
        stream = body.get("stream") is True
        ticket = await self.scheduler.admit(
            target, routing, arrived=arrived, stream=stream, caller=caller
        )
        call.ticket = ticket
        if ticket.refusal is not None:
            return await call.error(ticket.refusal)
        target = ticket.target
        if ticket.route == "fallback":
            assert target.fallback is not None
            return await self._forward_fallback(call, ticket, target.fallback, body, stream)
        mirrored = self.mirror.draw(target)  # the shadow step's share
        if mirrored and (seeded := self.mirror.seeded(body, call.path)) is not None:
            body, raw = seeded, json.dumps(seeded, ensure_ascii=False).encode()
        strip = stream and caller is not None and not usage.wants_usage(body)
        if strip:  # its tenant is charged the replica's usage, which the client did not ask
            raw = json.dumps(usage.asking_usage(body), ensure_ascii=False).encode()
        connect, deadlines = self.settings.timeouts(target, True)
        headers = _forward_headers(call.headers)
        headers["x-request-id"] = _attempt_id(headers.get("x-request-id"))
        if target.prefill is not None:  # P/D: the prompt may be computed on a prefill replica
            split = await prefill.split(
                self.scheduler, self.disagg, self.replicas, ticket, call.path, body, raw,
                headers, self.settings.connect_timeout,
            )  # fmt: skip
            if split is not raw:  # the decode leg's body: its own fields
                raw, body = split, json.loads(split)
        forward = Forward(
            call.path, raw, headers, stream, deadlines, connect, self.settings.attempts,
            None if stream else self._whole(call.path, body, raw),
            relay.Progress(self.pace, target.slo.itl_seconds, self.scheduler.load.progressed_since),
        )  # fmt: skip
        try:
            opened = await relay.open_upstream(forward, ticket, self.replicas, self.client)
        except relay.AllUpstreamsFailed as failed:
            return await call.error(ticket.attempts_failed(len(failed.failures)))
        if mirrored:  # the shadow step: after the request went out
            self.mirror.offer(target, opened.url, call.path, body, routing.prompt_chars, ticket,
                              drawn=True)  # fmt: skip
        if opened.assembled:
            assert opened.body is not None
            opened.response.close()
            return await self._send_whole(call, ticket, 200, "application/json", opened.body, None)
        strip_usage = usage.UsageStrip() if strip else None
        await self._answer(
            call, ticket, opened.response, opened.first, opened.body, None, strip_usage
        )

    def _uncounted(self, url: str) -> bool:
        """The replica's token counters are not known from a fresh scrape (none exported,
        or its scrapes stale): forwarded whole, a freeze there would be bounded only by the
        total timeout, so it gets non-streamed requests as streams (the default)."""
        stats = self.scheduler.load.stats(url)
        return stats is None or stats.tokens is None

    def _whole(self, path: str, body: dict[str, Any], raw: bytes) -> relay.Whole:
        """How a non-streamed request goes to each replica (`relay.Whole`): as a stream,
        its answer assembled here, where that buys a stall watch (by default a replica
        without fresh token counters: `_uncounted`), else whole, watched
        by the replica's counters (`relay.ProgressWatch`). `protocol.assemble` says which
        requests can be assembled; a replica that streams anyway is assembled too."""
        return relay.Whole(body, path, raw, self._streams, self.settings.max_response_bytes)

    async def _forward_fallback(
        self,
        call: _Call,
        ticket: Ticket,
        fallback: FallbackTarget,
        body: dict[str, Any],
        stream: bool,
    ) -> None:
        """Send to the external API (the ticket holds its concurrency slot). Its answers
        are relayed only when they succeed: an error body may carry the key the gateway
        sent it, so errors are the gateway's own words; redirects are not followed (the
        prompt goes nowhere else)."""
        target = ticket.target
        strip = stream and not usage.wants_usage(body)  # its usage is asked for, always
        outgoing = usage.asking_usage(body) if strip else dict(body)
        if fallback.model:
            outgoing["model"] = fallback.model
        headers = fallback_headers(call.headers, fallback.api_key)
        url = f"{fallback.url}{call.path.removeprefix('/v1')}"
        connect, deadlines = self.settings.timeouts(target, stream)
        timeout = aiohttp.ClientTimeout(
            total=deadlines.total, sock_connect=connect, sock_read=deadlines.first_byte
        )
        response: AiohttpResponse | None = None
        first: bytes = b""
        content: bytes | None = None
        try:
            raw = await self.client.post(
                url, json=outgoing, headers=headers, timeout=timeout, allow_redirects=False
            )
            response = AiohttpResponse(raw, self.settings.max_response_bytes)
            if response.status >= 300:
                retry_after = self.scheduler.settings.retry_after_seconds
                response.close()
                log.warning("fallback API answered HTTP %d for %s", raw.status, target.served_name)
                return await call.error(
                    ticket.fail(errors.fallback_refused(response.status, retry_after))
                )
            if stream:
                first = await response.readchunk()
            else:
                content = await response.read()
        except relay.UPSTREAM_ERRORS as error:
            if response is not None:
                response.close()
            failure = errors.upstream_failed(f"The fallback API failed: {type(error).__name__}.")
            return await call.error(ticket.fail(failure))
        except BaseException:
            if response is not None:
                response.close()
            raise
        strip_usage = usage.UsageStrip() if strip else None
        await self._answer(call, ticket, response, first, content, target.served_name, strip_usage)

    async def _answer(
        self,
        call: _Call,
        ticket: Ticket,
        response: AnyResponse,
        first: bytes,
        content: bytes | None,
        rename: str | None,
        strip: usage.UsageStrip | None = None,
    ) -> None:
        """Send an upstream's answer to the client: `content` when read whole, else the
        stream from `first` on; each piece goes through the ticket, which ends with it.
        `strip`: the usage event the gateway asked for is taken out of the client's stream."""
        status = response.status
        route = ticket.route
        if content is not None:
            response.close()
            content_type = _content_type(response.headers, "application/json")
            return await self._send_whole(call, ticket, status, content_type, content, rename)

        ticket.respond(status)
        call.started = True
        broken: str | None = None
        gone = False
        try:
            try:
                content_type = _content_type(response.headers, "text/event-stream")
                await call.send(
                    {
                        "type": "http.response.start",
                        "status": status,
                        "headers": _response_headers(route, content_type, status, None),
                    }
                )
                send = call.send if strip is None else _stripping(call.send, strip)
                broken = await relay.relay(response, first, send, ticket, rename)
            except OSError:  # the client's connection broke: stop
                gone = True
            except asyncio.CancelledError:  # the client left (DisconnectWatch)
                gone = True
                raise
        finally:  # however the stream ended
            response.close()
            ticket.finish(broken, client_gone=gone)

    async def _send_whole(
        self,
        call: _Call,
        ticket: Ticket,
        status: int,
        content_type: str,
        content: bytes,
        rename: str | None,
    ) -> None:
        """Send a whole answer (the ticket counts it, and ends, as it goes out)."""
        ticket.respond(status)
        ticket.chunk(content)
        ticket.finish()
        if rename and status == 200:
            content = _rename_json(content, rename)
        call.started = True
        headers = _response_headers(ticket.route, content_type, status, len(content))
        if call.send_whole is not None and call.send_whole(status, headers, content):
            return
        await call.send({"type": "http.response.start", "status": status, "headers": headers})
        await call.send({"type": "http.response.body", "body": content})

    def _refused(self, error: GatewayError) -> Response:
        """Count a request refused before it had a model (labels empty: no cardinality)."""
        self.scheduler.metrics.refused(error.status)
        return error.response()

    async def list_models(self, request: Request) -> Response:
        try:
            self.authenticate(request.headers.get("authorization"))
        except GatewayError as error:
            return error.response()
        return JSONResponse(model_cards(self.discovery.snapshot()))

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": len(self.discovery.snapshot())})

    @property
    def keyed(self) -> bool:
        """The API asks for a key (API key digests or tenants are configured)."""
        return bool(self.settings.api_key_hashes) or self.scheduler.tenancy is not None

    async def prometheus(self, request: Request) -> Response:
        self.scheduler.update_ready_gauge()  # ejections expire silently; refresh on each scrape
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# -------------------------------------------------------------------- helpers


class _Call:
    """One completion request: what its handlers share (its routing state is the ticket's)."""

    __slots__ = ("headers", "path", "send", "send_whole", "started", "ticket")

    def __init__(
        self,
        path: str,
        headers: dict[str, str],
        send: Send,
        send_whole: Callable[[int, list[tuple[bytes, bytes]], bytes], bool] | None = None,
    ) -> None:
        self.path = path
        self.headers = headers
        self.send = send
        self.send_whole = send_whole  # the gateway's server's one-write answer, if served so
        self.started = False  # the answer's status line went out
        self.ticket: Ticket | None = None

    async def error(self, error: GatewayError) -> None:
        self.started = True
        await error.response()({"type": "http"}, _no_receive, self.send)


class _Deadline:
    """`with _Deadline(seconds):` raises TimeoutError in the current task once `seconds`
    passed (its await cancelled), as `asyncio.timeout` does, with one loop timer and no
    async context manager: it bounds every request's body read."""

    __slots__ = ("_handle", "_task", "expired")

    def __init__(self, seconds: float) -> None:
        self._task = asyncio.current_task()
        self.expired = False
        self._handle = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self._task.cancel()  # type: ignore[union-attr]

    def __enter__(self) -> _Deadline:
        return self

    def __exit__(self, kind: object, error: object, tb: object) -> None:
        self._handle.cancel()
        if self.expired:
            self._task.uncancel()  # type: ignore[union-attr]  # our own cancel
            if kind is asyncio.CancelledError:
                raise TimeoutError


async def _receive_body(receive: Receive, limit: int) -> bytes:
    """The request body from ASGI `receive`, refused once it exceeds `limit` bytes."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientDisconnect()
    body = message.get("body", b"")
    if not message.get("more_body", False):  # the usual case: one message
        if len(body) > limit:
            raise errors.too_large(limit)
        return body
    buffer = bytearray(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        buffer += message.get("body", b"")
        if len(buffer) > limit:
            raise errors.too_large(limit)
        if not message.get("more_body", False):
            return bytes(buffer)


async def _no_receive() -> Message:
    raise RuntimeError("a response does not read the request")


# The request headers the gateway reads (ASGI servers send names in lower case).
_WANTED = frozenset(
    (
        b"authorization",
        b"content-length",
        b"x-session-id",
        *(h.encode() for h in TENANT_HEADERS),
        *(h.encode() for h in FORWARDED),
    )
)


def _wanted_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The headers the gateway reads, decoded; a repeated one as `headers.first_values`
    (its loop written out: a generator per request cost more than the lookups)."""
    out: dict[str, str] = {}
    for name, value in raw:
        if name in _WANTED and (key := name.decode()) not in out:
            out[key] = value.decode("latin-1")
    return out


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ID_PREFIX = os.urandom(6).hex()  # this process's; the counter makes each id unique in it
_ID_COUNTER = itertools.count(1)


def _attempt_id(client_id: str | None) -> str:
    """The `x-request-id` sent to a replica: unique (engines need unique request ids, and
    the answer must echo it), with the client's own id in front when it is a plain token."""
    ours = f"kl-{_ID_PREFIX}-{next(_ID_COUNTER):x}"
    return f"{client_id}.{ours}" if client_id and _REQUEST_ID.fullmatch(client_id) else ours


def _request_id(headers: dict[str, str]) -> str:
    """The client's `x-request-id` when it is a plain token, else a new one."""
    given = headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


_ROUTE_HEADER = ROUTE_HEADER.encode()

# A media type as RFC 9110 allows it, printable ASCII only: never a CR or LF to relay.
_MEDIA_TYPE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+/[!#$%&'*+.^_`|~0-9A-Za-z-]+[ -~]{0,200}")


def _content_type(headers: dict[str, str], default: str) -> str:
    """The upstream's content type if it is a well-formed one, else `default`."""
    value = headers.get("content-type", "")
    return value if _MEDIA_TYPE.fullmatch(value) else default


def _response_headers(
    route: str, content_type: str, status: int, length: int | None
) -> list[tuple[bytes, bytes]]:
    """What Starlette's Response (`length`: its body's) or StreamingResponse (None) sends with
    the `x-kubellm-route` header and the upstream's content type."""
    headers = [(_ROUTE_HEADER, route.encode("latin-1"))]
    if length is not None and not (status < 200 or status in (204, 304)):
        headers.append((b"content-length", str(length).encode("latin-1")))
    if content_type.startswith("text/") and "charset=" not in content_type.lower():
        content_type += "; charset=utf-8"
    headers.append((b"content-type", content_type.encode("latin-1")))
    return headers


def _forward_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k in FORWARDED if (v := headers.get(k))}


# The client headers the paid fallback API may see: what the answer's format and tracing
# need. Not `openai-organization` or `openai-project` (they would bill or steer the
# platform's account, whose key is sent), nor anything else a client sends.
FALLBACK_HEADERS = ("accept", "x-request-id")


def fallback_headers(headers: dict[str, str], api_key: str | None) -> dict[str, str]:
    """The headers of a request to the fallback API: the allowed client headers, JSON, and
    the platform's key."""
    out = {k: v for k in FALLBACK_HEADERS if (v := headers.get(k))}
    out["content-type"] = "application/json"
    if api_key:
        out["authorization"] = f"Bearer {api_key}"
    return out


def _stripping(send: Send, strip: usage.UsageStrip) -> Send:
    """`send` with the usage the client did not ask for taken out of its body pieces."""

    async def filtered(message: Message) -> None:
        if message["type"] == "http.response.body":
            body = strip.feed(message.get("body", b""))
            if not message.get("more_body", False):
                body += strip.end()
            message = {**message, "body": body}
            if not body and message.get("more_body", False):
                return
        await send(message)

    return filtered


def _rename_json(content: bytes, served_name: str) -> bytes:
    try:
        data = json.loads(content)
    except (ValueError, RecursionError):
        return content
    if isinstance(data, dict) and "model" in data:
        data["model"] = served_name
        return json.dumps(data).encode()
    return content


class _Completions:
    """The ASGI endpoint of one completion route, for what reaches it through Starlette
    (a request under a root path)."""

    __slots__ = ("gateway", "path")

    def __init__(self, gateway: Gateway, path: str) -> None:
        self.gateway = gateway
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.gateway.serve(self.path, scope, receive, send)


class GatewayApp:
    """The gateway's ASGI app: POSTs to the completion routes go straight to their
    handler; everything else (the other routes, 404s, 405s, lifespan) to Starlette."""

    def __init__(self, gateway: Gateway, app: Starlette) -> None:
        self.gateway = gateway
        self.app = app
        self.state = app.state
        self._serve = gateway.serve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            path = scope["path"]
            if path in (CHAT, COMPLETIONS):
                return await self._serve(path, scope, receive, send)
        await self.app(scope, receive, send)

    def proxy_headers_around(self, trusted_hosts: list[str] | str) -> None:
        """The server's proxy headers (`X-Forwarded-For`, `X-Forwarded-Proto` from
        `trusted_hosts`) for what Starlette serves, not for the completion routes' raw
        handler, which reads neither the client's address nor the scheme
        (`http/server.py`'s `config` asks this where no access log shows the address)."""
        self.app = ProxyHeadersMiddleware(self.app, trusted_hosts=trusted_hosts)  # type: ignore[assignment]


def create_app(gateway: Gateway, metrics_route: bool = True) -> GatewayApp:
    """The ASGI app; starting it starts discovery and scraping, stopping it stops them.
    `metrics_route=False` leaves `/metrics` off (served on its own port instead). Where the
    API asks for a key, `/metrics` is refused here (403) whatever key comes: it shows every
    tenant's usage, so it is served on the metrics port only (`create_metrics_app`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    async def not_found(request: Request, exc: Exception) -> Response:
        return GatewayError(404, f"Unknown path {request.url.path}.", code="not_found").response()

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return GatewayError(
            405, f"Method {request.method} not allowed.", code="method_not_allowed"
        ).response()

    routes = [
        HttpRoute(CHAT, _Completions(gateway, CHAT), methods=["POST"]),
        HttpRoute(COMPLETIONS, _Completions(gateway, COMPLETIONS), methods=["POST"]),
        HttpRoute("/v1/models", gateway.list_models, methods=["GET"]),
        HttpRoute("/health", gateway.health, methods=["GET"]),
    ]
    if metrics_route:
        served = _metrics_elsewhere if gateway.keyed else gateway.prometheus
        routes.append(HttpRoute("/metrics", served, methods=["GET"]))
    app = Starlette(
        routes=routes,
        exception_handlers={404: not_found, 405: not_allowed},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return GatewayApp(gateway, app)


async def _metrics_elsewhere(request: Request) -> Response:
    return GatewayError(
        403,
        "/metrics is not served on the API port when API keys or tenants are configured (it "
        "shows every tenant's usage); run the gateway with --metrics-port and scrape that.",
        "permission_error",
        "metrics_on_metrics_port",
    ).response()


def create_metrics_app(gateway: Gateway) -> Starlette:
    """`/metrics` alone, for a separate port (`kubellm gateway --metrics-port`)."""
    return Starlette(routes=[HttpRoute("/metrics", gateway.prometheus, methods=["GET"])])
