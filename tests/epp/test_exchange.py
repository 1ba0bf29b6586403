"""The picker's side of one ext_proc exchange, message by message, without Envoy: the
protocol cases an Envoy test cannot easily provoke (subset hints, buffered and streamed
body modes, oversized bodies, requests naming no model)."""

from __future__ import annotations

import json

import envoy_data_plane.envoy.config.core.v3 as core
import envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 as mode
import envoy_data_plane.envoy.service.ext_proc.v3 as ext
import envoy_data_plane.google.protobuf as pb
import pytest
from kubellm.gateway.discovery.base import AdapterRef, Endpoint, FixedDiscovery, ModelTarget
from kubellm.gateway.epp import messages as m
from kubellm.gateway.epp.server import EndpointPicker, Exchange, PickerSettings

REPLICAS = ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")
BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()
Mode = mode.ProcessingModeBodySendMode


def _picker(**settings: object) -> EndpointPicker:
    target = ModelTarget("tiny", "tiny", endpoints=tuple(Endpoint(u) for u in REPLICAS))
    return EndpointPicker(FixedDiscovery({"tiny": target}), PickerSettings(**settings))


def _headers(
    path: str = "/v1/completions", end: bool = False, **kw: object
) -> ext.ProcessingRequest:
    values = [(":method", "POST"), (":path", path), ("content-type", "application/json")]
    return ext.ProcessingRequest(
        request_headers=ext.HttpHeaders(
            headers=core.HeaderMap(
                headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in values]
            ),
            end_of_stream=end,
        ),
        **kw,
    )


def _config(request: Mode, response: Mode = Mode.FULL_DUPLEX_STREAMED) -> ext.ProtocolConfiguration:
    return ext.ProtocolConfiguration(request_body_mode=request, response_body_mode=response)


def _subset(*endpoints: str) -> core.Metadata:
    values = pb.ListValue(values=[pb.Value(string_value=e) for e in endpoints])
    hint = pb.Struct(fields={m.SUBSET: pb.Value(list_value=values)})
    return core.Metadata(filter_metadata={m.SUBSET_NAMESPACE: hint})


def _body(data: bytes = BODY, end: bool = True) -> ext.ProcessingRequest:
    return ext.ProcessingRequest(request_body=ext.HttpBody(body=data, end_of_stream=end))


def _destination(answer: ext.ProcessingResponse) -> tuple[str, str]:
    """(header value, metadata value) of a routing answer."""
    phase = answer.request_headers or answer.request_body
    assert phase is not None and phase.response is not None
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
    assert exchange.picker.scheduler.load.in_flight[exchange.url] == 1
    exchange.close()  # the stream ended before a response: released
    assert exchange.picker.scheduler.load.in_flight.get(exchange.url, 0) == 0


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
    assert answer.request_body is not None and answer.request_body.response.clear_route_cache
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


async def test_a_request_without_a_body_goes_to_the_least_loaded_endpoint():
    picker = _picker()
    busy = picker.scheduler.acquire(REPLICAS[0])
    exchange = Exchange(picker)
    answers = await exchange.handle(_headers("/v1/models", end=True))
    header, _ = _destination(answers[0])
    assert header != REPLICAS[0].removeprefix("http://")
    busy()


async def test_the_response_releases_and_5xx_answers_eject_the_replica():
    target = ModelTarget("tiny", "tiny", endpoints=(Endpoint(REPLICAS[0]),))
    picker = EndpointPicker(FixedDiscovery({"tiny": target}), PickerSettings())
    status = core.HeaderMap(headers=[core.HeaderValue(key=":status", raw_value=b"503")])
    for _ in range(picker.scheduler.outliers.threshold):
        exchange = Exchange(picker)
        await exchange.handle(_headers(protocol_config=_config(Mode.FULL_DUPLEX_STREAMED)))
        await exchange.handle(_body())
        answer = ext.ProcessingRequest(
            response_headers=ext.HttpHeaders(headers=status, end_of_stream=True)
        )
        (replaced,) = await exchange.handle(answer)
        # the core's answer in place of the replica's 503, as the HTTP gateway gives it
        assert replaced.immediate_response.status.code == 502
        error = json.loads(replaced.immediate_response.body)["error"]
        assert error["code"] == "upstream_error"
        assert picker.scheduler.load.in_flight.get(REPLICAS[0], 0) == 0
    assert picker.scheduler.outliers.ejected(REPLICAS[0])


async def test_a_client_hanging_up_after_done_is_a_complete_answer():
    picker = _picker()
    exchange = Exchange(picker)
    await exchange.handle(_headers(protocol_config=_config(Mode.FULL_DUPLEX_STREAMED)))
    await exchange.handle(_body())
    status = core.HeaderMap(headers=[core.HeaderValue(key=":status", raw_value=b"200")])
    await exchange.handle(ext.ProcessingRequest(response_headers=ext.HttpHeaders(headers=status)))
    last = b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n'
    await exchange.handle(ext.ProcessingRequest(response_body=ext.HttpBody(body=last)))
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
