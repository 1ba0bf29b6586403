"""Envoy's ext_proc messages for tests that speak to the picker directly, as the picker's
protobuf runtime builds them (gateway/epp/messages.py): `core.HeaderMap(...)`,
`ext.ProcessingRequest(...)`, named after their Envoy packages."""

from __future__ import annotations

from types import SimpleNamespace

from kubellm.gateway.epp import messages as m

core = SimpleNamespace(
    HeaderMap=m.message("envoy.config.core.v3.HeaderMap"),
    HeaderValue=m.message("envoy.config.core.v3.HeaderValue"),
)
ext = SimpleNamespace(
    ProcessingRequest=m.ProcessingRequest,
    ProcessingResponse=m.ProcessingResponse,
    HttpHeaders=m.message("envoy.service.ext_proc.v3.HttpHeaders"),
    HttpBody=m.message("envoy.service.ext_proc.v3.HttpBody"),
    ProtocolConfiguration=m.message("envoy.service.ext_proc.v3.ProtocolConfiguration"),
)
