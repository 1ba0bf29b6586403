"""One rule for a repeated request header, in both front ends (issue 39): the HTTP gateway
and the endpoint picker read the same value, the first, as Envoy's own lookup does."""

from __future__ import annotations

from kubellm.gateway.epp import messages as m
from kubellm.gateway.http.app import _wanted_headers
from kubellm.gateway.protocol.headers import first_values

REPEATED = [
    ("authorization", "Bearer first-key"),
    ("x-session-id", "s1"),
    ("authorization", "Bearer second-key"),
    ("x-gateway-inference-fairness-id", "f1"),
    ("x-session-id", "s2"),
    ("x-gateway-inference-fairness-id", "f2"),
]
FIRST = {"authorization": "Bearer first-key", "x-session-id": "s1",
         "x-gateway-inference-fairness-id": "f1"}  # fmt: skip


def test_a_repeated_header_keeps_its_first_value():
    assert first_values(REPEATED) == FIRST


def test_the_gateway_and_the_picker_read_a_repeated_header_alike():
    gateway = _wanted_headers([(k.encode(), v.encode()) for k, v in REPEATED])
    header_map = m.message("envoy.config.core.v3.HeaderMap")(
        headers=[{"key": k, "raw_value": v.encode()} for k, v in REPEATED]
    )
    picker = m.headers(m.message("envoy.service.ext_proc.v3.HttpHeaders")(headers=header_map))
    assert gateway == picker == FIRST
