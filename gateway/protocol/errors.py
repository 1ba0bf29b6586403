"""Errors in OpenAI's envelope: `{"error": {"message", "type", "param", "code"}}`.

Every error the gateway answers goes through `GatewayError`, so clients (the
official `openai` SDK included) see the same shape whether the request failed
here or at an engine. `x-should-retry: false` tells the SDK not to retry where
a retry cannot help (bad input, unknown model, body too large, bad key).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

_NO_RETRY = {400, 401, 404, 413}


class GatewayError(Exception):
    """A request the gateway answers with an error; carries the HTTP status and envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        if status in _NO_RETRY:
            self.headers.setdefault("x-should-retry", "false")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse_error_event(message: str, type_: str = "server_error", code: str | None = None) -> bytes:
    """An SSE event carrying an error envelope: how a stream that broke mid-way ends."""
    payload = json.dumps(error_body(message, type_, code))
    return f"data: {payload}\n\n".encode()


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", "invalid_request", param)


def model_not_found(model: str) -> GatewayError:
    return GatewayError(
        404,
        f"The model `{model}` does not exist or is not served by this gateway.",
        "invalid_request_error",
        "model_not_found",
        "model",
    )


def too_large(limit: int) -> GatewayError:
    return GatewayError(
        413,
        f"Request body exceeds the gateway's limit of {limit} bytes.",
        "invalid_request_error",
        "request_too_large",
    )


def unauthorized() -> GatewayError:
    return GatewayError(
        401,
        "Incorrect or missing API key: send it as `Authorization: Bearer <key>`.",
        "authentication_error",
        "invalid_api_key",
    )


def overloaded(
    model: str, retry_after: int, status: int = 429, loading: str | None = None
) -> GatewayError:
    """A refusal for lack of capacity; `loading`: the adapter whose load on a replica is
    still under way (the request's deadline came first)."""
    message = (
        f"Model `{model}` is at capacity; retry after {retry_after} s."
        if loading is None
        else f"Adapter `{loading}` of model `{model}` is being loaded on a replica and was "
        f"not ready within the request's deadline; retry after {retry_after} s."
    )
    return GatewayError(
        status,
        message,
        "rate_limit_error" if status == 429 else "server_error",
        "rate_limit_exceeded" if status == 429 else "service_unavailable",
        headers={"Retry-After": str(retry_after)},
    )


def upstream_failed(message: str) -> GatewayError:
    return GatewayError(502, message, "server_error", "upstream_error")


def body_timeout(seconds: float) -> GatewayError:
    return GatewayError(
        408,
        f"The request body did not arrive within {seconds:g} s.",
        "invalid_request_error",
        "request_timeout",
    )


def internal(request_id: str) -> GatewayError:
    """An unexpected failure inside the gateway: the id finds its one log record."""
    return GatewayError(
        500,
        f"The gateway failed unexpectedly (request id {request_id}); it has been logged.",
        "server_error",
        "internal_error",
        headers={"x-request-id": request_id},
    )


def fallback_refused(status: int, retry_after: int) -> GatewayError:
    """The fallback API answered with an error or a redirect, in the gateway's own words:
    its body and headers are never relayed (they may carry the key the gateway sent)."""
    if status in (401, 403, 407):
        return GatewayError(
            502,
            f"The fallback API rejected the gateway's credentials (HTTP {status}); "
            "the operator must check the fallback's API key.",
            "server_error",
            "fallback_auth_failed",
        )
    if 300 <= status < 400:
        return GatewayError(
            502,
            f"The fallback API answered with a redirect (HTTP {status}), "
            "which the gateway does not follow.",
            "server_error",
            "fallback_redirect",
        )
    if status == 429:
        return GatewayError(
            429,
            "The fallback API is rate-limiting the gateway (HTTP 429).",
            "rate_limit_error",
            "rate_limit_exceeded",
            headers={"Retry-After": str(retry_after)},
        )
    if status in (400, 413, 422):
        return GatewayError(
            400,
            f"The fallback API refused the request as invalid (HTTP {status}).",
            "invalid_request_error",
            "fallback_rejected_request",
        )
    return GatewayError(
        502, f"The fallback API failed (HTTP {status}).", "server_error", "upstream_error"
    )


def _raw(status: str, message: str, type_: str, code: str, extra: str = "") -> bytes:
    body = json.dumps(error_body(message, type_, code)).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}connection: close\r\n\r\n"
    )
    return head.encode() + body


def server_busy() -> bytes:
    """The raw HTTP/1.1 answer to a connection over the gateway's cap: written before any
    request is read, so it is bytes, not a response object."""
    return _raw(
        "503 Service Unavailable",
        "The gateway has too many open connections; retry shortly.",
        "server_error",
        "too_many_connections",
        "retry-after: 1\r\n",
    )


def headers_too_large() -> bytes:
    """The raw answer to a request whose line and headers exceed the gateway's limit."""
    return _raw(
        "431 Request Header Fields Too Large",
        "The request's headers exceed the gateway's limit.",
        "invalid_request_error",
        "headers_too_large",
    )
