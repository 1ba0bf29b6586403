"""A hostile ext_proc client (the port has no authentication) against the picker's real
gRPC server on 127.0.0.1: messages out of the protocol's order close the stream with
INVALID_ARGUMENT, and no in-flight slot outlives the stream (issue 27, item 6: six
`request_headers(end_of_stream=true)` on one stream acquired six slots and released one,
so with `--max-in-flight 1` every later request of every client was shed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
from kubellm.gateway.discovery.base import Endpoint, FixedDiscovery, ModelTarget
from kubellm.gateway.epp import messages as m
from kubellm.gateway.epp import rpc
from kubellm.gateway.epp.server import EndpointPicker, PickerSettings, serve
from kubellm.gateway.routing.admission import Thresholds
from kubellm.gateway.routing.scheduler import SchedulerSettings

from tests.fixtures.polling import eventually
from tests.gateway.epp.protos import core, ext

REPLICA = "http://10.0.0.1:8000"
METHOD = f"/{m.SERVICE}/{m.METHOD}"


def _headers(path: str, end: bool) -> Any:
    values = [(":method", "POST"), (":path", path), ("content-type", "application/json")]
    return ext.ProcessingRequest(
        request_headers=ext.HttpHeaders(
            headers=core.HeaderMap(
                headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in values]
            ),
            end_of_stream=end,
        )
    )


def _response_headers(status: int) -> Any:
    values = core.HeaderMap(headers=[core.HeaderValue(key=":status", raw_value=b"%d" % status)])
    return ext.ProcessingRequest(response_headers=ext.HttpHeaders(headers=values))


def _body(model: str = "tiny", stream: bool = False) -> Any:
    data = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2, "stream": stream}).encode()
    return ext.ProcessingRequest(request_body=ext.HttpBody(body=data, end_of_stream=True))


# Each test runs with a client deadline (grpc-timeout: grpclib's own stream handling) and
# without one, as Envoy opens ext_proc streams (rpc.LeanHandler serves those).
@pytest.fixture(params=[None, 10.0], ids=["as-envoy", "deadline"])
async def picker_server(request) -> AsyncIterator[tuple[EndpointPicker, str, float | None]]:
    target = ModelTarget("tiny", "tiny", endpoints=(Endpoint(REPLICA),))
    settings = PickerSettings(scheduler=SchedulerSettings(thresholds=Thresholds(max_in_flight=1)))
    picker = EndpointPicker(FixedDiscovery({"tiny": target}), settings)
    servers = await serve(picker, "127.0.0.1", 0, None, None)
    try:
        yield picker, f"127.0.0.1:{servers.ports['grpc']}", request.param
    finally:
        await servers.stop(0)


def _stream(channel: grpc.aio.Channel, timeout: float | None) -> Any:
    """One ext_proc stream on `channel`, as Envoy opens it (with `timeout`: a deadline)."""
    return channel.stream_stream(
        METHOD,
        request_serializer=m.serialize,
        response_deserializer=ext.ProcessingResponse.FromString,
    )(timeout=timeout)


async def _exchange(
    address: str, timeout: float | None, messages: list[Any]
) -> tuple[list[Any], grpc.StatusCode]:
    """Send `messages` on one stream as Envoy does, each after the picker answered the one
    before; the answers and the stream's final status as the picker set it. Once the picker
    has closed the stream nothing more is written (a write racing the close would fail on
    the client's side and hide the picker's status behind the client's own INTERNAL)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = _stream(channel, timeout)
        answers: list[Any] = []
        arrived: asyncio.Queue[bool] = asyncio.Queue()

        async def read() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for answer in call:
                    answers.append(answer)
                    arrived.put_nowait(True)
            arrived.put_nowait(False)  # the stream ended

        reader = asyncio.create_task(read())
        for message in messages:
            await call.write(message)
            if not await arrived.get():
                break
        else:
            await call.done_writing()
        await reader
        return answers, await call.code()


def _in_flight(picker: EndpointPicker) -> int:
    return sum(picker.scheduler.in_flight().values())


async def test_repeated_request_headers_close_the_stream_and_leak_no_slot(picker_server):
    picker, address, timeout = picker_server
    answers, code = await _exchange(address, timeout, [_headers("/v1/models", end=True)] * 6)
    await eventually(lambda: _in_flight(picker) == 0, 5, "the slots to be released")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(answers) == 1 and answers[0].HasField("immediate_response")  # the first answered
    # with --max-in-flight 1 the next client is routed, not shed
    answers, code = await _exchange(
        address, timeout, [_headers("/v1/completions", end=False), _body()]
    )
    assert code == grpc.StatusCode.OK
    assert not answers[0].HasField("immediate_response"), answers[0]
    assert answers[0].HasField("request_body") or answers[0].HasField("request_headers")


async def test_a_local_reply_before_any_request_is_passed_on_and_acquires_nothing(
    picker_server,
):
    # Envoy's own reply (the buffer filter's 413) reaches the picker's encode side with no
    # request message before it: it must pass, not fail the client's answer with a 500.
    picker, address, timeout = picker_server
    answers, code = await _exchange(address, timeout, [_response_headers(413)])
    assert code == grpc.StatusCode.OK
    assert len(answers) == 1 and answers[0].HasField("response_headers")
    assert _in_flight(picker) == 0


@pytest.mark.parametrize(
    "messages",
    [
        [_response_headers(413), _headers("/v1/completions", end=True)],  # a request after
        [_headers("/v1/completions", end=False), _body(), _body(), _headers("/x", end=True)],
        [  # (a stream: the picker follows its answer; a non-streamed one's ends at its
            # status line, where the picker closes the stream)
            _headers("/v1/completions", end=False),
            _body(stream=True),
            _response_headers(200),
            _headers("/v1/completions", end=True),
        ],
    ],
    ids=["request-after-response", "headers-after-body", "headers-after-response"],
)
async def test_out_of_order_messages_are_invalid_argument_and_release_every_slot(
    picker_server, messages
):
    picker, address, timeout = picker_server
    _, code = await _exchange(address, timeout, messages)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    await eventually(lambda: _in_flight(picker) == 0, 5, "the slots to be released")
    series = picker.metrics.registry.get_sample_value(
        "kubellm_gateway_pending_requests",
        {"model": "tiny", "deployment": "tiny", "namespace": "default"},
    )
    assert not series  # no request left pending


async def test_a_message_longer_than_the_limit_is_refused_before_it_is_read(picker_server):
    # grpclib reads whatever length a message's prefix announces: the picker's server
    # checks the prefix first (rpc.Call.read), so a peer cannot make it hold an endless
    # message; the limit is the body limit plus 1 MiB for the rest of the message.
    picker, address, timeout = picker_server
    size = picker.settings.max_body_bytes + (2 << 20)
    huge = ext.ProcessingRequest(request_body=ext.HttpBody(body=b"x" * size, end_of_stream=True))
    answers, code = await _exchange(
        address, timeout, [_headers("/v1/completions", end=False), huge]
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(answers) == 1  # the headers' answer; nothing for the refused message
    await eventually(lambda: picker.streams == 0 and picker.buffered == 0, 5, "the stream to end")


async def test_envoys_stream_form_is_served_by_the_lean_handler_a_deadline_by_grpclib(
    picker_server, monkeypatch
):
    # (so the tests above cover both: rpc.LeanHandler takes a stream without grpc-timeout)
    picker, address, timeout = picker_server
    served: list[Any] = []
    serve_lean = rpc.ExtProc.serve

    async def spy(self: rpc.ExtProc, raw: Any, release: Any) -> None:
        served.append(raw)
        await serve_lean(self, raw, release)

    monkeypatch.setattr(rpc.ExtProc, "serve", spy)
    messages = [_headers("/v1/completions", end=False), _body()]
    answers, code = await _exchange(address, timeout, messages)
    assert code == grpc.StatusCode.OK
    assert answers[-1].HasField("request_body")
    assert len(served) == (1 if timeout is None else 0)
    await eventually(lambda: picker.streams == 0, 5, "the stream to end")


async def test_answers_beyond_the_peers_window_go_out_whole(picker_server):
    # In full-duplex mode the picker sends the request's body back after its route, in
    # pieces of 1 MiB: 6 MB is more than the client's stream window (grpc's 4 MiB), so the
    # last pieces wait for its WINDOW_UPDATEs (rpc.LeanCall.write sends an answer that
    # fits the frame size and the windows directly, any other through grpclib's split).
    picker, address, timeout = picker_server
    headers = _headers("/v1/completions", end=False)
    headers.protocol_config.CopyFrom(
        ext.ProtocolConfiguration(request_body_mode=m.FULL_DUPLEX, response_body_mode=m.FULL_DUPLEX)
    )
    data = json.dumps({"model": "tiny", "prompt": "x" * 6_000_000, "max_tokens": 2}).encode()
    body = ext.ProcessingRequest(request_body=ext.HttpBody(body=data, end_of_stream=True))
    async with grpc.aio.insecure_channel(address) as channel:
        call = _stream(channel, timeout)
        await call.write(headers)
        await call.write(body)
        route = await call.read()
        pieces = []
        while not pieces or not pieces[-1].end_of_stream:
            piece = await call.read()
            pieces.append(piece.request_body.response.body_mutation.streamed_response)
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    assert route.HasField("request_headers")
    assert len(pieces) == 6 and b"".join(piece.body for piece in pieces) == data
    await eventually(lambda: picker.streams == 0, 5, "the stream to end")


@pytest.mark.parametrize(
    ("method", "content_type", "status"),
    [("GET", "application/grpc", "405"), ("POST", "text/plain", "415")],
    ids=["get", "content-type"],
)
async def test_other_forms_of_the_ext_proc_path_meet_grpclibs_checks(
    picker_server, method, content_type, status
):
    # only Envoy's form is served by rpc.LeanHandler; anything else is refused as grpclib
    # refuses it, also with the right content type before a wrong one (the last counts)
    picker, address, _ = picker_server
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(
        1,
        [(":method", method), (":path", METHOD), (":scheme", "http"),
         (":authority", "epp"), ("te", "trailers"), ("content-type", "application/grpc"),
         ("content-type", content_type)],
        end_stream=True,
    )  # fmt: skip
    writer.write(client.data_to_send())
    answered = None
    while answered is None:
        data = await reader.read(65536)
        assert data, "the connection closed before an answer"
        for event in client.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                answered = dict(event.headers)[b":status"].decode()
        writer.write(client.data_to_send())
    writer.close()
    assert answered == status
    assert picker.streams == 0  # the picker never saw it


async def test_both_grpc_ports_answer_health_checks() -> None:
    """The ext_proc port (its server takes headers in bytes for the lean handler) and the
    health port (a server without ext_proc, headers as h2 decodes them) both answer."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = ModelTarget("tiny", "tiny", endpoints=(Endpoint(REPLICA),))
    picker = EndpointPicker(FixedDiscovery({"tiny": target}), PickerSettings())
    servers = await serve(picker, "127.0.0.1", 0, 0, None)
    try:
        for name in ("grpc", "health"):
            address = f"127.0.0.1:{servers.ports[name]}"
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                request = health_pb2.HealthCheckRequest(service="readiness")
                answer = await stub.Check(request, timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, name
    finally:
        await servers.stop(0)
