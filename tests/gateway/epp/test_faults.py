"""The endpoint picker against misbehaving ext_proc clients (the port has no
authentication): request bodies that never end, more streams than it should hold, and
many streams each buffering megabytes. A real `kubellm epp` process on 127.0.0.1 and a
raw gRPC client speaking ext_proc to it, as a hostile peer would (issue 27, item 7).
Memory is the process's peak resident set (VmHWM), as in tests/gateway/faults."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from kubellm.gateway.epp import messages as m

from tests.fixtures.engines import free_port, wait_until
from tests.fixtures.polling import eventually
from tests.gateway.epp.conftest import START_TIMEOUT_S, Process, responds
from tests.gateway.faults.peers import vm_peak_mib

METHOD = f"/{m.SERVICE}/{m.METHOD}"
HttpHeaders = m.message("envoy.service.ext_proc.v3.HttpHeaders")
HttpBody = m.message("envoy.service.ext_proc.v3.HttpBody")
ANSWER_TIMEOUT_S = 10.0


class Picker:
    def __init__(self, process: Process, grpc_port: int) -> None:
        self.process = process
        self.address = f"127.0.0.1:{grpc_port}"

    @property
    def peak_mib(self) -> float:
        assert self.process.popen is not None
        return vm_peak_mib(self.process.popen.pid)


@pytest.fixture
def picker(tmp_path: Path) -> Iterator[Callable[..., Picker]]:
    started: list[Process] = []

    def start(*flags: str) -> Picker:
        static = tmp_path / "models.yaml"
        nobody = f"http://127.0.0.1:{free_port()}"  # never contacted by these tests' requests
        static.write_text(yaml.safe_dump({"models": [{"name": "tiny", "endpoints": [nobody]}]}))
        grpc_port, metrics_port = free_port(), free_port()
        process = Process("epp", [
            sys.executable, "-m", "kubellm.cli", "epp", "--static", str(static),
            "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port", "0",
            "--metrics-port", str(metrics_port), *flags,
        ], tmp_path / f"epp-{grpc_port}.log").start()  # fmt: skip
        started.append(process)
        health = f"http://127.0.0.1:{metrics_port}/health"
        wait_until(
            lambda: not process.alive() or responds(health), START_TIMEOUT_S, "the EPP to serve"
        )
        assert process.alive(), process.tail()
        return Picker(process, grpc_port)

    yield start
    for process in started:
        with contextlib.suppress(OSError):
            process.stop()


@contextlib.asynccontextmanager
async def channel(address: str) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as open_channel:
        yield open_channel


def stream(open_channel: grpc.aio.Channel) -> Any:
    return open_channel.stream_stream(
        METHOD,
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=m.ProcessingResponse.FromString,
    )()


def headers(end: bool = False) -> Any:
    values = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
    return m.ProcessingRequest(
        request_headers=HttpHeaders(
            headers={"headers": [{"key": k, "raw_value": v.encode()} for k, v in values.items()]},
            end_of_stream=end,
        ),
        protocol_config={"request_body_mode": m.FULL_DUPLEX, "response_body_mode": m.FULL_DUPLEX},
    )


def body(data: bytes, end: bool = False) -> Any:
    return m.ProcessingRequest(request_body=HttpBody(body=data, end_of_stream=end))


def error_of(answer: Any) -> tuple[int, dict[str, Any]]:
    assert answer.WhichOneof("response") == "immediate_response", answer
    immediate = answer.immediate_response
    return immediate.status.code, json.loads(immediate.body)["error"]


async def test_a_request_body_that_never_ends_gets_a_408_at_the_deadline(picker):
    epp = picker("--body-timeout", "1")
    async with channel(epp.address) as open_channel:
        trickle = stream(open_channel)
        await trickle.write(headers())
        await trickle.write(body(b'{"model": "tiny", "prompt": "'))  # and never the rest
        silent = stream(open_channel)  # a stream that sends nothing at all
        await silent.write(headers())
        for call in (trickle, silent):
            status, error = error_of(await asyncio.wait_for(call.read(), ANSWER_TIMEOUT_S))
            assert (status, error["code"]) == (408, "request_timeout")
            assert await asyncio.wait_for(call.read(), ANSWER_TIMEOUT_S) is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK


async def test_streams_beyond_the_cap_are_refused_and_a_closed_one_frees_its_place(picker):
    epp = picker("--max-streams", "8", "--body-timeout", "60")
    async with channel(epp.address) as open_channel:
        held = [stream(open_channel) for _ in range(8)]
        for call in held:
            await call.write(headers())  # a body is announced and never sent

        async def refused() -> bool:
            extra = stream(open_channel)
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                await extra.write(headers(end=True))
                await asyncio.wait_for(extra.read(), ANSWER_TIMEOUT_S)
            if not extra.done():  # answered and still open: it was served
                extra.cancel()
                return False
            return await extra.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        # Once the eight are open (the server sees them in its own time), a ninth is refused.
        await eventually(refused, ANSWER_TIMEOUT_S, "a ninth stream to be refused")
        assert "--max-streams" in await (await _refused_call(open_channel)).details()

        held.pop().cancel()  # the client leaves: its place is free again

        async def answered() -> bool:
            fresh = stream(open_channel)
            await fresh.write(headers(end=True))  # no body: answered at once
            try:
                answer = await asyncio.wait_for(fresh.read(), ANSWER_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                return False
            fresh.cancel()
            return answer is not grpc.aio.EOF

        await eventually(answered, ANSWER_TIMEOUT_S, "a stream to be served again")
        for call in held:
            call.cancel()


async def _refused_call(open_channel: grpc.aio.Channel) -> Any:
    call = stream(open_channel)
    with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
        await call.write(headers(end=True))
        await asyncio.wait_for(call.read(), ANSWER_TIMEOUT_S)
    assert call.done()
    assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return call


async def test_forty_streams_buffering_seven_mib_each_leave_memory_bounded(picker):
    cap = 16 * 1024 * 1024
    epp = picker("--max-buffered-bytes", str(cap), "--body-timeout", "60")
    piece = b"x" * (256 * 1024)
    per_stream = 7 * 1024 * 1024
    before = epp.peak_mib

    async def fill(open_channel: grpc.aio.Channel) -> tuple[Any, Any]:
        call = stream(open_channel)
        await call.write(headers())
        answer = asyncio.ensure_future(call.read())
        sent = 0
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            while sent < per_stream and not answer.done():
                await call.write(body(piece))  # never the end of the body
                sent += len(piece)
        return call, answer

    async with channel(epp.address) as open_channel:
        filled = await asyncio.gather(*(fill(open_channel) for _ in range(40)))
        answers = [answer for _, answer in filled]
        # At most the cap is held: two whole 7 MiB bodies fit in 16 MiB, the rest are refused.
        expected = 40 - cap // per_stream - 1
        await eventually(
            lambda: sum(a.done() for a in answers) >= expected,
            ANSWER_TIMEOUT_S,
            f"at least {expected} of 40 streams refused",
        )
        for answer in answers:
            if answer.done():
                status, error = error_of(answer.result())
                assert (status, error["code"]) == (503, "service_unavailable")
                assert "--max-buffered-bytes" in error["message"]
        grown = epp.peak_mib - before
        for call, answer in filled:
            answer.cancel()
            call.cancel()
    print(f"40 streams x 7 MiB, --max-buffered-bytes 16 MiB: peak RSS grew {grown:.0f} MiB")
    assert grown < 120, f"the picker's peak memory grew by {grown:.0f} MiB"
    assert epp.process.alive(), epp.process.tail()
