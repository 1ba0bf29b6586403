"""The standalone Envoy bootstrap's ext_proc filter, as data (no Envoy started): what it
sends the picker. That the picker still gets what it reads through a real Envoy is
tests/gateway/epp/test_envoy.py's and test_tenancy.py's (sessions, tenant headers)."""

from __future__ import annotations

from kubellm.gateway.epp import envoy
from kubellm.gateway.epp.server import SESSION_HEADER
from kubellm.gateway.routing.flow.tenants import FAIRNESS_HEADER, OBJECTIVE_HEADER, PRIORITY_HEADER

from kubellm.contracts import POOL_HEADER


def _ext_proc(config: dict) -> dict:
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return next(
        f["typed_config"] for f in manager["http_filters"] if f["name"].endswith("ext_proc")
    )


def test_envoy_sends_the_picker_only_the_headers_it_reads():
    """Headers are matched pseudo-headers included (Envoy 1.40): the path and status line
    must be listed, and nothing the picker does not read (cookies, user agents, a client's
    other credentials) is in its messages."""
    for fail_open in (False, True):
        config = envoy.bootstrap("127.0.0.1:1", "127.0.0.1:2", ["127.0.0.1:3"], fail_open)
        rules = _ext_proc(config)["forward_rules"]["allowed_headers"]["patterns"]
        assert {rule["exact"] for rule in rules} == {
            ":path", ":method", ":status", "authorization", SESSION_HEADER, POOL_HEADER,
            PRIORITY_HEADER, OBJECTIVE_HEADER, FAIRNESS_HEADER,
        }  # fmt: skip
