"""The gateway's ASGI app: one OpenAI-compatible endpoint in front of a fleet.

Per request: authenticate, read the body within the size limit, parse and
check it, find the model, then admission (`fallback.decide`) picks replica,
fallback, queue or reject before any byte is sent. Replica requests are
ordered by the model's routing profile and forwarded with retries before the
first byte; answers are relayed unchanged (streams chunk by chunk) and timed
for the SLO metrics. Every outcome is counted in `kubellm_gateway_requests_total`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubellm.gateway import proxy, slo_metrics, upstream
from kubellm.gateway.discovery.base import Discovery, FallbackTarget, ModelTarget
from kubellm.gateway.fallback import (
    CompletionRate,
    Route,
    Thresholds,
    decide,
    predicted_wait,
    saturated,
)
from kubellm.gateway.load import LoadView, scrape_loop
from kubellm.gateway.outliers import OutlierDetector
from kubellm.gateway.protocol import errors
from kubellm.gateway.protocol.errors import GatewayError
from kubellm.gateway.router import Router, routing_request
from kubellm.gateway.scorers.base import Candidate, RoutingRequest
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute
from starlette.types import Message, Receive, Scope, Send

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FORWARDED = proxy.FORWARDED_HEADERS


def hash_key(key: str) -> str:
    """How API keys are stored in configuration: sha256 hex of the key."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class GatewaySettings:
    """Knobs that are the gateway's own (per-model settings come from discovery)."""

    max_body_bytes: int = 8 * 1024 * 1024
    api_key_hashes: frozenset[str] = frozenset()  # sha256 hex; empty: no authentication
    thresholds: Thresholds = field(default_factory=Thresholds)
    max_queue: int = 256  # waiting requests per model
    zero_replica_wait_seconds: float = 60.0  # queue budget while a model has no replica
    retry_after_seconds: int = 1
    attempts: int = 3  # replicas tried before the first byte
    scrape_interval: float = 1.0
    stale_after: float = 5.0
    connect_timeout: float = 5.0
    read_timeout: float = 300.0  # longest silence from an engine, mid-stream included
    eject_after_failures: int = 3
    eject_base_seconds: float = 5.0


class Gateway:
    """State shared by all requests of one gateway process."""

    def __init__(
        self,
        discovery: Discovery,
        settings: GatewaySettings | None = None,
        client: aiohttp.ClientSession | None = None,
    ) -> None:
        self.discovery = discovery
        self.settings = s = settings or GatewaySettings()
        self.metrics = slo_metrics.create()
        self.load = LoadView(stale_after=s.stale_after)
        self.outliers = OutlierDetector(s.eject_after_failures, s.eject_base_seconds)
        self.router = Router(self.load, self.outliers)
        self._client = client  # the fallback API's and scraping's client; made when first used
        self._replicas: upstream.Pool | None = None  # the replicas' client
        self.fallback_in_flight: dict[str, int] = {}
        self.queued: dict[str, int] = {}
        self.completed = CompletionRate()  # replica answers finished, to predict queue waits
        self._changed = asyncio.Event()
        self.load.on_release(self.wake)
        self._tasks: list[asyncio.Task[None]] = []

    # ---------------------------------------------------------------- lifecycle

    @property
    def client(self) -> aiohttp.ClientSession:
        if self._client is None:
            s = self.settings
            self._client = proxy.new_session(s.connect_timeout, s.read_timeout)
        return self._client

    @property
    def replicas(self) -> upstream.Pool:
        """The client for engine replicas (plain http): keep-alive, request written at once."""
        if self._replicas is None:
            s = self.settings
            self._replicas = upstream.Pool(s.connect_timeout, s.read_timeout)
        return self._replicas

    def wake(self) -> None:
        """Capacity may have freed: let queued requests look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    def topology_changed(self) -> None:
        """Endpoints appeared, left or were ejected."""
        self.wake()
        self._update_ready_gauge()

    def _update_ready_gauge(self) -> None:
        for target in self.discovery.snapshot().values():
            labels = _labels(target)
            ready = sum(1 for e in target.routable if not self.outliers.ejected(e.url))
            self.metrics.ready_endpoints.labels(*labels).set(ready)
            slo = target.slo
            self.metrics.publish_slo(labels, slo.ttft_seconds, slo.itl_seconds, slo.objective)

    def _engine_urls(self) -> list[str]:
        return [e.url for t in self.discovery.snapshot().values() for e in t.endpoints]

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self.discovery.run(self.topology_changed)),
            asyncio.create_task(
                scrape_loop(
                    self.client, self._engine_urls, self.load, self.settings.scrape_interval
                )
            ),
        ]
        self._update_ready_gauge()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._replicas is not None:
            await self._replicas.close()
            self._replicas = None

    # ---------------------------------------------------------------- checks

    def authenticate(self, authorization: str | None) -> None:
        """Check the `Authorization` header's value (None: absent) against the key hashes."""
        if not self.settings.api_key_hashes:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or hash_key(key.strip()) not in self.settings.api_key_hashes:
            raise errors.unauthorized()

    async def read_body(self, receive: Receive, declared: str | None) -> bytes:
        """The request body, refused once it exceeds the limit (`declared`: its content-length)."""
        limit = self.settings.max_body_bytes
        if declared and declared.isdigit() and int(declared) > limit:
            raise errors.too_large(limit)
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

    # ---------------------------------------------------------------- admission

    async def admit(
        self, target: ModelTarget, routing: RoutingRequest
    ) -> tuple[ModelTarget, Route, str, list[Candidate], float]:
        """Wait (bounded) until the request can go somewhere.

        Returns the model's current target (endpoints may change while waiting),
        the route and its reason, the candidates best first, and the time waited.
        """
        model = target.served_name
        start = time.monotonic()
        ready_now = bool(self.router.candidates(target))
        budget = target.slo.ttft_seconds if ready_now else self.settings.zero_replica_wait_seconds
        deadline = start + budget
        queued = False
        try:
            while True:
                changed = self._changed
                # re-read: endpoints may have appeared (scale from zero) or gone meanwhile
                target = self.discovery.snapshot().get(model, target)
                candidates = self.router.candidates(target)
                thresholds = self.settings.thresholds
                open_ = [c for c in candidates if not saturated(c, thresholds)]
                now = time.monotonic()
                waiting = self.queued.get(model, 0)
                room = queued or waiting < self.settings.max_queue
                position = waiting if queued else waiting + 1
                rate = 0.0 if open_ else self.completed.rate(c.url for c in candidates)
                decision = decide(
                    ready=len(candidates),
                    unsaturated=len(open_),
                    fallback=target.fallback,
                    fallback_in_flight=self.fallback_in_flight.get(model, 0),
                    may_wait=room and now < deadline,
                    wait=predicted_wait(position, rate),
                    budget_left=deadline - now if ready_now else 0.0,
                )
                if decision.route is not Route.QUEUE:
                    order = self.router.order(target, routing, open_) if open_ else []
                    return target, decision.route, decision.reason, order, now - start
                if not queued:
                    queued = True
                    self.queued[model] = self.queued.get(model, 0) + 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout=min(deadline - now, 0.5))
        finally:
            if queued:
                self.queued[model] -= 1

    # ---------------------------------------------------------------- handlers

    async def serve(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        """POST `path` (CHAT or COMPLETIONS), as a raw ASGI handler.

        Served without Starlette's request and response objects: a stream in flight
        holds few objects, and none in a reference cycle, so it costs the cyclic
        garbage collector little (its pauses land on every stream in flight).
        """
        arrived = time.monotonic()
        headers = _wanted_headers(scope["headers"])
        try:
            self.authenticate(headers.get("authorization"))
            raw = await self.read_body(receive, headers.get("content-length"))
            body = parse_body(raw, path)
        except GatewayError as error:
            return await self._refused(error)(scope, receive, send)
        except ClientDisconnect:
            return await Response(status_code=499)(scope, receive, send)
        model = body["model"]
        target = self.discovery.snapshot().get(model)
        if target is None:
            return await self._refused(errors.model_not_found(model))(scope, receive, send)
        call = _Call(self.metrics.target(_labels(target)), arrived, path, headers, send)
        # Until the answer is sent, a client that leaves cancels the work: the upstream
        # request is closed (its response is closed in `finally` blocks), so an engine
        # stops working for a client that left, queued, waiting or mid-stream.
        try:
            async with proxy.DisconnectWatch(receive) as watch:
                await self._route(call, target, raw, body)
        except BaseException:
            call.finish("none", 499)
            raise
        if watch.disconnected and not call.started:
            call.finish("none", 499)  # queued or waiting for a non-streamed answer
            await Response(status_code=499)(scope, receive, send)

    async def _route(
        self, call: _Call, target: ModelTarget, raw: bytes, body: dict[str, Any]
    ) -> None:
        """Admission, then forwarding to a replica or the fallback, or a refusal."""
        model = target.served_name
        routing = routing_request(model, body, call.headers.get("x-session-id"))
        target, route, reason, order, waited = await self.admit(target, routing)
        self.metrics.target(_labels(target)).queue_wait.observe(waited)
        if route is Route.REJECT:
            # saturated: 429, come back soon; no replica at all: 503 until one is up
            status = 429 if reason == "saturated" else 503
            error = errors.overloaded(model, self.settings.retry_after_seconds, status)
            call.finish("none", error.status)
            return await call.error(error)
        if route is Route.FALLBACK:
            assert target.fallback is not None
            self.metrics.fallback.labels(*_labels(target), reason).inc()
            return await self._forward_fallback(call, target, target.fallback, body)
        return await self._forward_replicas(call, target, routing, order, raw, body)

    async def _forward_replicas(
        self,
        call: _Call,
        target: ModelTarget,
        routing: RoutingRequest,
        order: list[Candidate],
        raw: bytes,
        body: dict[str, Any],
    ) -> None:
        path = call.path
        targets = [(c.url, c.url + path) for c in order]
        try:
            attempt = await proxy.open_upstream(
                self.replicas,
                targets,
                raw,
                _forward_headers(call.headers),
                self.load.acquire,
                self._failed,
                self.outliers.success,
                self.settings.attempts,
                self.client,
            )
        except proxy.AllUpstreamsFailed as failed:
            error = errors.upstream_failed(
                f"No replica of `{target.served_name}` answered ({len(failed.failures)} tried)."
            )
            call.finish("replica", error.status)
            return await call.error(error)
        ratio = self.router.routed(routing, attempt.url, [c.url for c in order])
        self.metrics.target(_labels(target)).prefix_match.observe(ratio)
        release, url, completed = attempt.release, attempt.url, self.completed

        def release_completed() -> None:
            nonlocal release
            if release is not None:  # once: count the answer toward the completion rate
                completed.record(url)
                release()
                release = None

        await self._relay(call, target, attempt.response, release_completed, body, "replica", None)

    def _refused(self, error: GatewayError) -> Response:
        """Count a request refused before it had a model (labels empty: no cardinality)."""
        self.metrics.requests.labels("", "", "", "none", str(error.status)).inc()
        return error.response()

    def _failed(self, url: str) -> None:
        if self.outliers.failure(url):
            self.topology_changed()

    async def _forward_fallback(
        self, call: _Call, target: ModelTarget, fallback: FallbackTarget, body: dict[str, Any]
    ) -> None:
        model = target.served_name
        self.fallback_in_flight[model] = self.fallback_in_flight.get(model, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.fallback_in_flight[model] -= 1
                self.wake()

        outgoing = dict(body)
        if fallback.model:
            outgoing["model"] = fallback.model
        headers = _forward_headers(call.headers)
        if fallback.api_key:
            headers["authorization"] = f"Bearer {fallback.api_key}"
        url = f"{fallback.url}{call.path.removeprefix('/v1')}"
        headers.setdefault("content-type", "application/json")
        try:
            response = await self.client.post(url, json=outgoing, headers=headers)
        except proxy.UPSTREAM_ERRORS as error:
            release()
            failure = errors.upstream_failed(f"The fallback API failed: {type(error).__name__}.")
            call.finish("fallback", failure.status)
            return await call.error(failure)
        except BaseException:
            release()
            raise
        await self._relay(call, target, response, release, body, "fallback", model)

    async def _relay(
        self,
        call: _Call,
        target: ModelTarget,
        response: proxy.AnyResponse,
        release: Callable[[], None],
        body: dict[str, Any],
        route: str,
        rename: str | None,
    ) -> None:
        series = call.series
        content_type = response.headers.get("content-type", "application/json")
        status = response.status
        streaming = body.get("stream") is True and status == 200
        if not streaming:
            content: bytes | None
            try:
                content = await response.read()
            except proxy.UPSTREAM_ERRORS:
                content = None
            finally:
                proxy.close_response(response)
                release()
            if content is None:
                error = errors.upstream_failed("The upstream failed while answering.")
                call.finish(route, error.status)
                return await call.error(error)
            if rename and status == 200:
                content = _rename_json(content, rename)
            elapsed = time.monotonic() - call.arrived
            if status == 200:
                series.ttft.observe(elapsed)
                if route == "fallback":
                    for kind, count in _usage(content).items():
                        self.metrics.fallback_tokens.labels(*series.labels, kind).inc(count)
                slo = target.slo
                # within the TTFT target, the budget is met whatever the token count: no parse
                if elapsed <= slo.ttft_seconds or elapsed <= (
                    slo.ttft_seconds + slo.itl_seconds * _completion_tokens(content)
                ):
                    series.goodput.inc()
            call.finish(route, status)
            call.started = True
            send = call.send
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": _response_headers(route, content_type, status, len(content)),
                }
            )
            await send({"type": "http.response.body", "body": content})
            return

        timing = proxy.StreamTiming(start=call.arrived)
        call.started = True
        try:
            with contextlib.suppress(OSError):  # the client's connection broke: stop
                await call.send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": _response_headers(route, content_type, 200, None),
                    }
                )
                await proxy.relay(response, call.send, timing, rename)
        finally:  # however the stream ended (a client leaving cancels the relay)
            proxy.close_response(response)
            release()
            if timing.ttft is not None:
                series.ttft.observe(timing.ttft)
            for gap in timing.gaps:
                series.itl.observe(gap)
            completed = timing.error is None and timing.first is not None
            if completed and slo_metrics.met_slo(
                timing.ttft, timing.mean_itl, target.slo.ttft_seconds, target.slo.itl_seconds
            ):
                series.goodput.inc()
            call.finish(route, 200 if completed else 502)

    async def list_models(self, request: Request) -> Response:
        try:
            self.authenticate(request.headers.get("authorization"))
        except GatewayError as error:
            return error.response()
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "kubellm"}
            for name in sorted(self.discovery.snapshot())
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": len(self.discovery.snapshot())})

    async def prometheus(self, request: Request) -> Response:
        self._update_ready_gauge()  # ejections expire silently; refresh on each scrape
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# -------------------------------------------------------------------- helpers


class _Call:
    """One completion request: what its handlers share, and its outcome counted once."""

    __slots__ = ("arrived", "finished", "headers", "path", "send", "series", "started")

    def __init__(
        self,
        series: slo_metrics.TargetMetrics,
        arrived: float,
        path: str,
        headers: dict[str, str],
        send: Send,
    ) -> None:
        self.series = series
        self.arrived = arrived
        self.path = path
        self.headers = headers
        self.send = send
        self.finished = False
        self.started = False  # the answer's status line went out
        series.pending.inc()

    def finish(self, route: str, code: int) -> None:
        if self.finished:
            return
        self.finished = True
        series = self.series
        series.pending.dec()
        series.requests(route, code).inc()
        series.e2e.observe(time.monotonic() - self.arrived)

    async def error(self, error: GatewayError) -> None:
        self.started = True
        await error.response()({"type": "http"}, _no_receive, self.send)


async def _no_receive() -> Message:
    raise RuntimeError("a response does not read the request")


# The request headers the gateway reads (ASGI servers send names in lower case).
_WANTED = frozenset(
    (b"authorization", b"content-length", b"x-session-id", *(h.encode() for h in FORWARDED))
)


def _wanted_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The headers the gateway reads, decoded; the first value of a repeated one."""
    out: dict[str, str] = {}
    for name, value in raw:
        if name in _WANTED:
            key = name.decode()
            if key not in out:
                out[key] = value.decode("latin-1")
    return out


def _response_headers(
    route: str, content_type: str, status: int, length: int | None
) -> list[tuple[bytes, bytes]]:
    """What Starlette's Response (`length`: its body's) or StreamingResponse (None) sends with
    the `x-kubellm-route` header and the upstream's content type."""
    headers = [(b"x-kubellm-route", route.encode("latin-1"))]
    if length is not None and not (status < 200 or status in (204, 304)):
        headers.append((b"content-length", str(length).encode("latin-1")))
    if content_type.startswith("text/") and "charset=" not in content_type.lower():
        content_type += "; charset=utf-8"
    headers.append((b"content-type", content_type.encode("latin-1")))
    return headers


def _labels(target: ModelTarget) -> tuple[str, str, str]:
    return (target.served_name, target.deployment, target.namespace)


def _forward_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k in FORWARDED if (v := headers.get(k))}


def _rename_json(content: bytes, served_name: str) -> bytes:
    try:
        data = json.loads(content)
    except ValueError:
        return content
    if isinstance(data, dict) and "model" in data:
        data["model"] = served_name
        return json.dumps(data).encode()
    return content


def _usage(content: bytes) -> dict[str, int]:
    """prompt and completion token counts from a non-streamed response's `usage`."""
    try:
        usage = json.loads(content).get("usage") or {}
        return {
            "prompt": int(usage.get("prompt_tokens") or 0),
            "completion": int(usage.get("completion_tokens") or 0),
        }
    except (ValueError, AttributeError, TypeError):
        return {}


def _completion_tokens(content: bytes) -> int:
    try:
        usage = json.loads(content).get("usage") or {}
        return int(usage.get("completion_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


def parse_body(raw: bytes, path: str) -> dict[str, Any]:
    """Parse and check the fields the gateway relies on; the rest passes through unchecked."""
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise errors.bad_request(f"Request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise errors.bad_request("Request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request("`model` is required and must be a non-empty string.", "model")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise errors.bad_request("`stream` must be a boolean.", "stream")
    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise errors.bad_request("`messages` must be a non-empty array.", "messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise errors.bad_request("Each message must be an object with a `role`.", "messages")
    elif "prompt" not in body:
        raise errors.bad_request("`prompt` is required.", "prompt")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise errors.bad_request(f"`{name}` must be a positive integer.", name)
    temperature = body.get("temperature")
    if temperature is not None and (
        not isinstance(temperature, int | float)
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise errors.bad_request("`temperature` must be a number >= 0.", "temperature")
    return body


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


def create_app(gateway: Gateway) -> GatewayApp:
    """The ASGI app; starting it starts discovery and scraping, stopping it stops them."""

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

    app = Starlette(
        routes=[
            HttpRoute(CHAT, _Completions(gateway, CHAT), methods=["POST"]),
            HttpRoute(COMPLETIONS, _Completions(gateway, COMPLETIONS), methods=["POST"]),
            HttpRoute("/v1/models", gateway.list_models, methods=["GET"]),
            HttpRoute("/health", gateway.health, methods=["GET"]),
            HttpRoute("/metrics", gateway.prometheus, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: not_allowed},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return GatewayApp(gateway, app)
