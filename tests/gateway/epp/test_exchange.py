"""The picker's side of one ext_proc exchange, message by message, without Envoy: the
protocol cases an Envoy test cannot easily provoke (subset hints, buffered and streamed
body modes, oversized bodies, requests naming no model)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubellm.gateway.discovery.base import AdapterRef, Endpoint, FixedDiscovery, ModelTarget
from kubellm.gateway.epp import messages as m
from kubellm.gateway.epp.server import EndpointPicker, Exchange, PickerSettings
from kubellm.gateway.routing.settings import SchedulerSettings

from kubellm.contracts import POOL_HEADER

REPLICAS = ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")
BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()
ProcessingRequest = m.ProcessingRequest
HttpHeaders = m.message("envoy.service.ext_proc.v3.HttpHeaders")
HttpBody = m.message("envoy.service.ext_proc.v3.HttpBody")
ProtocolConfiguration = m.message("envoy.service.ext_proc.v3.ProtocolConfiguration")
HeaderMap = m.message("envoy.config.core.v3.HeaderMap")
HeaderValue = m.message("envoy.config.core.v3.HeaderValue")
Metadata = m.message("envoy.config.core.v3.Metadata")
Struct = m.message("google.protobuf.Struct")
Value = m.message("google.protobuf.Value")
ListValue = m.message("google.protobuf.ListValue")


class Mode:
    FULL_DUPLEX_STREAMED = m.FULL_DUPLEX
    BUFFERED = m.BUFFERED
    STREAMED = m.STREAMED


def _picker(**settings: object) -> EndpointPicker:
    target = ModelTarget("tiny", "tiny", endpoints=tuple(Endpoint(u) for u in REPLICAS))
    return EndpointPicker(FixedDiscovery({"tiny": target}), PickerSettings(**settings))


def _status(code: bytes) -> Any:
    return HeaderMap(headers=[HeaderValue(key=":status", raw_value=code)])


def _headers(path: str = "/v1/completions", end: bool = False, **kw: object) -> Any:
    values = [(":method", "POST"), (":path", path), ("content-type", "application/json")]
    return ProcessingRequest(
        request_headers=HttpHeaders(
            headers=HeaderMap(
                headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values]
            ),
            end_of_stream=end,
        ),
        **kw,
    )


def _config(request: int, response: int = Mode.FULL_DUPLEX_STREAMED) -> Any:
    return ProtocolConfiguration(request_body_mode=request, response_body_mode=response)


def _subset(*endpoints: str) -> Any:
    values = ListValue(values=[Value(string_value=e) for e in endpoints])
    hint = Struct(fields={m.SUBSET: Value(list_value=values)})
    return Metadata(filter_metadata={m.SUBSET_NAMESPACE: hint})


def _body(data: bytes = BODY, end: bool = True) -> Any:
    return ProcessingRequest(request_body=HttpBody(body=data, end_of_stream=end))


def _parsed(answer: Any) -> Any:
    """An answer as a message (the picker writes some answers serialised already)."""
    return m.ProcessingResponse.FromString(answer) if isinstance(answer, bytes) else answer


def _destination(answer: Any) -> tuple[str, str]:
    """(header value, metadata value) of a routing answer."""
    answer = _parsed(answer)
    which = answer.WhichOneof("response")
    assert which in ("request_headers", "request_body")
    phase = getattr(answer, which)
    header = {h.header.key: h.header.raw_value.decode()
              for h in phase.response.header_mutation.set_headers}[m.DESTINATION]  # fmt: skip
    inner = answer.dynamic_metadata.fields[m.METADATA_NAMESPACE].struct_value
    return header, inner.fields[m.DESTINATION].string_value


async def test_full_duplex_routes_after_the_body_and_echoes_it():
    exchange = Exchange(_picker())
    assert await exchange.handle(_headers(protocol_config=_config(Mode.FULL_DUPLEX_STREAMED))) == []
    assert await exchange.handle(_body(BODY[:10], end=False)) == []
    answers = await exchange.handle(_body(BODY[10:]))
    header, metadata = _destination(answers[0])
    assert header == metadata and header in {u.removeprefix("http://") for u in REPLICAS}
    echoed = answers[1].request_body.response.body_mutation.streamed_response
    assert (echoed.body, echoed.end_of_stream) == (BODY, True)
    assert exchange.picker.scheduler.in_flight() == {exchange.url: 1}
    exchange.close()  # the stream ended before a response: released
    assert exchange.picker.scheduler.in_flight() == {}


async def test_subset_hint_limits_the_pick_and_an_empty_match_is_503():
    exchange = Exchange(_picker())
    allowed = "10.0.0.3:8000"
    first = _headers(
        protocol_config=_config(Mode.FULL_DUPLEX_STREAMED), metadata_context=_subset(allowed)
    )
    await exchange.handle(first)
    answers = await exchange.handle(_body())
    assert _destination(answers[0]) == (allowed, allowed)

    exchange = Exchange(_picker())
    await exchange.handle(_headers(protocol_config=_config(Mode.FULL_DUPLEX_STREAMED),
                                   metadata_context=_subset("10.9.9.9:8000")))  # fmt: skip
    (answer,) = await exchange.handle(_body())
    assert answer.immediate_response.status.code == 503
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "service_unavailable"


async def test_buffered_mode_answers_headers_at_once_and_routes_on_the_body():
    exchange = Exchange(_picker())
    (first,) = await exchange.handle(_headers(protocol_config=_config(Mode.BUFFERED)))
    assert first == m.CONTINUE_REQUEST_HEADERS
    (answer,) = await exchange.handle(_body())
    answer = _parsed(answer)
    assert answer.WhichOneof("response") == "request_body"
    assert answer.request_body.response.clear_route_cache
    header, metadata = _destination(answer)
    assert header == metadata


async def test_streamed_request_mode_is_refused_with_the_reason():
    exchange = Exchange(_picker())
    (answer,) = await exchange.handle(_headers(protocol_config=_config(Mode.STREAMED)))
    assert answer.immediate_response.status.code == 500
    assert "FULL_DUPLEX_STREAMED" in json.loads(answer.immediate_response.body)["error"]["message"]


async def test_a_body_over_the_limit_is_413():
    exchange = Exchange(_picker(max_body_bytes=64))
    await exchange.handle(_headers(protocol_config=_config(Mode.FULL_DUPLEX_STREAMED)))
    (answer,) = await exchange.handle(_body(b"x" * 65, end=False))
    assert answer.immediate_response.status.code == 413


@pytest.mark.parametrize("count", [1, 3])
async def test_endpoints_per_answer_lists_fallbacks_best_first(count):
    exchange = Exchange(_picker(endpoints_per_answer=count))
    await exchange.handle(_headers(protocol_config=_config(Mode.FULL_DUPLEX_STREAMED)))
    answers = await exchange.handle(_body())
    header, metadata = _destination(answers[0])
    assert header == metadata and len(header.split(",")) == count
    assert header.split(",")[0] == exchange.url.removeprefix("http://")


def _headers_of(path: str, method: str, pool: str | None = None, end: bool = True) -> Any:
    values = [(":method", method), (":path", path)] + ([(POOL_HEADER, pool)] if pool else [])
    headers = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values])
    return ProcessingRequest(request_headers=HttpHeaders(headers=headers, end_of_stream=end))


def _two_pools() -> EndpointPicker:
    """A shared picker: models `a` and `b`, each its own InferencePool."""
    targets = {
        name: ModelTarget(name, name, endpoints=(Endpoint(url),), pool=f"{name}-engine")
        for name, url in (("a", REPLICAS[0]), ("b", REPLICAS[1]))
    }
    return EndpointPicker(FixedDiscovery(targets), PickerSettings())


async def test_a_request_naming_no_model_reaches_no_replica():
    """Issue 39.22: `GET /v1/models` is answered by the picker (the route's pool's models);
    any other request naming no model is a 404; no replica is picked for either."""
    picker = _two_pools()
    for pool, listed in (("a-engine", ["a"]), ("default/b-engine", ["b"])):
        (answer,) = await Exchange(picker).handle(_headers_of("/v1/models", "GET", pool))
        assert answer.immediate_response.status.code == 200
        cards = json.loads(answer.immediate_response.body)["data"]
        assert [c["id"] for c in cards] == listed
    for path, method in (("/admin/anything", "GET"), ("/v1/models", "POST"), ("/", "GET")):
        (answer,) = await Exchange(picker).handle(_headers_of(path, method, "a-engine"))
        assert answer.immediate_response.status.code == 404, path
    assert picker.scheduler.in_flight() == {}


async def test_a_shared_picker_never_crosses_the_pool_the_route_names():
    """Issue 39.22: through pool A's route, a body naming pool B's model is a 404 and never
    reaches B's endpoint; B's route reaches B. (A route that names no pool leaves the
    picker its whole scope: every route kubellm writes names its pool.)"""
    picker = _two_pools()
    body = ProcessingRequest(
        request_body=HttpBody(body=json.dumps({"model": "b", "prompt": "x"}).encode(),
                              end_of_stream=True)
    )  # fmt: skip
    for pool, code in (("a-engine", 404), ("default/a-engine", 404), ("other/a-engine", 404)):
        exchange = Exchange(picker)
        await exchange.handle(_headers_of("/v1/completions", "POST", pool, end=False))
        (answer,) = await exchange.handle(body)
        assert answer.immediate_response.status.code == code, pool
        assert exchange.url is None
    exchange = Exchange(picker)  # B's own route still reaches B
    await exchange.handle(_headers_of("/v1/completions", "POST", "b-engine", end=False))
    await exchange.handle(body)
    assert exchange.url == REPLICAS[1]


async def test_the_response_releases_and_5xx_answers_eject_the_replica():
    target = ModelTarget("tiny", "tiny", endpoints=(Endpoint(REPLICAS[0]),))
    core = SchedulerSettings(eject_base_seconds=300, zero_replica_wait_seconds=0.5)
    picker = EndpointPicker(FixedDiscovery({"tiny": target}), PickerSettings(scheduler=core))
    status = _status(b"503")
    for _ in range(picker.scheduler.outliers.threshold):
        exchange = Exchange(picker)
        await exchange.handle(_headers(protocol_config=_config(Mode.FULL_DUPLEX_STREAMED)))
        await exchange.handle(_body())
        answer = ProcessingRequest(response_headers=HttpHeaders(headers=status, end_of_stream=True))
        (replaced,) = await exchange.handle(answer)
        # the core's answer in place of the replica's 503, as the HTTP gateway gives it
        assert replaced.immediate_response.status.code == 502
        error = json.loads(replaced.immediate_response.body)["error"]
        assert error["code"] == "upstream_error"
        assert REPLICAS[0] not in picker.scheduler.in_flight()
    assert picker.scheduler.outliers.ejected(REPLICAS[0])
    # the pool's only replica, ejected: still picked (no fallback here), not held back
    exchange = Exchange(picker)
    await exchange.handle(_headers(protocol_config=_config(Mode.FULL_DUPLEX_STREAMED)))
    await exchange.handle(_body())
    assert exchange.url == REPLICAS[0]


async def test_a_client_hanging_up_after_done_is_a_complete_answer():
    picker = _picker()
    exchange = Exchange(picker)
    await exchange.handle(_headers(protocol_config=_config(Mode.FULL_DUPLEX_STREAMED)))
    await exchange.handle(_body())
    status = _status(b"200")
    await exchange.handle(ProcessingRequest(response_headers=HttpHeaders(headers=status)))
    last = b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n'
    await exchange.handle(ProcessingRequest(response_body=HttpBody(body=last)))
    exchange.close()  # the client left before Envoy passed on the body's end
    labels = {"model": "tiny", "deployment": "tiny", "namespace": "default",
              "target": "replica", "code": "200"}  # fmt: skip
    assert picker.metrics.registry.get_sample_value("kubellm_gateway_requests_total", labels) == 1


async def test_a_lora_adapter_name_routes_to_a_replica_that_has_it():
    endpoints = tuple(Endpoint(u) for u in REPLICAS)
    target = ModelTarget("tiny", "tiny", endpoints=endpoints, adapters=(AdapterRef("sql", "/a"),))
    picker = EndpointPicker(FixedDiscovery({"tiny": target}), PickerSettings())
    picker.scheduler.adapters.record_registered(REPLICAS[2], ["sql"])
    exchange = Exchange(picker)
    await exchange.handle(_headers(protocol_config=_config(Mode.FULL_DUPLEX_STREAMED)))
    body = json.dumps({"model": "sql", "prompt": "select", "max_tokens": 2}).encode()
    answers = await exchange.handle(_body(body))
    assert _destination(answers[0])[0] == REPLICAS[2].removeprefix("http://")


def _response(status: bytes = b"200") -> Any:
    return ProcessingRequest(response_headers=HttpHeaders(headers=_status(status)))


def _count(picker: EndpointPicker, name: str, **labels: str) -> float:
    base = {"model": "tiny", "deployment": "tiny", "namespace": "default"}
    return picker.metrics.registry.get_sample_value(name, {**base, **labels}) or 0.0


@pytest.mark.parametrize(
    ("stream", "response_mode", "skipped"),
    [
        (False, Mode.STREAMED, True),  # within its TTFT target: nothing more to learn
        (True, Mode.STREAMED, False),  # TTFT and ITL come from the events
        (False, Mode.FULL_DUPLEX_STREAMED, False),  # Envoy ignores overrides in this mode
    ],
)
async def test_the_picker_stops_envoy_sending_what_the_core_does_not_need(
    stream, response_mode, skipped
):
    picker = _picker()
    exchange = Exchange(picker)
    request = Mode.FULL_DUPLEX_STREAMED if response_mode == Mode.FULL_DUPLEX_STREAMED else (
        Mode.BUFFERED
    )  # fmt: skip
    await exchange.handle(_headers(protocol_config=_config(request, response_mode)))
    body = json.dumps({"model": "tiny", "prompt": "hello", "stream": stream}).encode()
    await exchange.handle(_body(body))
    (answer,) = await exchange.handle(_response())
    if not skipped:
        assert answer == m.CONTINUE_RESPONSE_HEADERS
        return
    assert answer == m.skip_response_body(Mode.BUFFERED)
    parsed = m.ProcessingResponse.FromString(answer)
    assert parsed.HasField("response_headers")
    assert parsed.mode_override.response_body_mode == m.NONE
    assert parsed.mode_override.request_body_mode == Mode.BUFFERED
    # Envoy then closes the stream: the end, counted once, whole, and the slot freed
    exchange.close()
    exchange.close()
    assert _count(picker, "kubellm_gateway_requests_total", target="replica", code="200") == 1
    assert _count(picker, "kubellm_gateway_time_to_first_token_seconds_count") == 1
    assert _count(picker, "kubellm_gateway_slo_met_requests_total") == 1
    assert all(v == 0 for v in picker.scheduler.load.in_flight.values())


async def test_an_exchange_whose_body_is_not_needed_ends_at_the_status_line():
    """The picker ends the stream after its answer to the response headers (Envoy then
    relays the body alone, with or without `allow_mode_override`): the request is counted
    and its slot freed at once, before any close of Envoy's."""
    picker = _picker()
    exchange = Exchange(picker)
    await exchange.handle(_headers(protocol_config=_config(Mode.BUFFERED, Mode.STREAMED)))
    await exchange.handle(_body())
    await exchange.handle(_response())
    assert exchange.over
    assert _count(picker, "kubellm_gateway_requests_total", target="replica", code="200") == 1
    assert all(v == 0 for v in picker.scheduler.load.in_flight.values())
    exchange.close()
    assert _count(picker, "kubellm_gateway_requests_total", target="replica", code="200") == 1
