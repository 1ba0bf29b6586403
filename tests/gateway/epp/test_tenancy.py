"""The endpoint picker authenticates tenants from the headers Envoy passes and honours the
Inference Extension's objective and fairness id, through the same core as the HTTP
gateway (one ext_proc exchange, message by message, without Envoy)."""

from __future__ import annotations

import json
import time
from typing import Any

from kubellm.gateway.discovery.base import Endpoint, FixedDiscovery, ModelTarget
from kubellm.gateway.epp import messages as m
from kubellm.gateway.epp.server import EndpointPicker, Exchange, PickerSettings
from kubellm.gateway.routing.flow import tenants
from kubellm.gateway.routing.flow.controller import TenancySettings
from kubellm.gateway.routing.settings import SchedulerSettings

from tests.fixtures.polling import eventually
from tests.gateway.epp.protos import core, ext
from tests.gateway.epp.test_exchange import _parsed

REPLICAS = ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()
DOC = {
    "tenants": [
        {"name": "chat-app", "priority": 10, "apiKeys": [f"sha256:{tenants.digest('sk-chat')}"]},
        {"name": "meter", "requestsPerMinute": 1, "apiKeys": [f"sha256:{tenants.digest('sk-m')}"]},
    ],
    "objectives": {"batch": -2},
}


def _picker() -> EndpointPicker:
    target = ModelTarget("tiny", "tiny", endpoints=tuple(Endpoint(u) for u in REPLICAS))
    tenancy = TenancySettings(tenants.parse(DOC))
    return EndpointPicker(
        FixedDiscovery({"tiny": target}),
        PickerSettings(scheduler=SchedulerSettings(tenancy=tenancy)),
    )


def _headers(**extra: str) -> Any:
    values = [(":method", "POST"), (":path", "/v1/completions"),
              ("content-type", "application/json"), *extra.items()]  # fmt: skip
    config = ext.ProtocolConfiguration(
        request_body_mode=m.FULL_DUPLEX, response_body_mode=m.FULL_DUPLEX
    )
    return ext.ProcessingRequest(
        request_headers=ext.HttpHeaders(
            headers=core.HeaderMap(
                headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in values]
            )
        ),
        protocol_config=config,
    )


async def _route(picker: EndpointPicker, **headers: str) -> tuple[Exchange, list]:
    exchange = Exchange(picker)
    await exchange.handle(_headers(**headers))
    answers = await exchange.handle(ext.ProcessingRequest(
        request_body=ext.HttpBody(body=BODY, end_of_stream=True)
    ))  # fmt: skip
    return exchange, answers


async def test_an_unknown_or_missing_key_is_401_in_openais_envelope():
    picker = _picker()
    for headers in ({}, {"authorization": "Bearer sk-nobody"}):
        _, (answer,) = await _route(picker, **headers)
        assert answer.immediate_response.status.code == 401
        assert json.loads(answer.immediate_response.body)["error"]["code"] == "invalid_api_key"


async def test_the_key_names_the_tenant_the_objective_and_fairness_id_are_honoured():
    picker = _picker()
    exchange, answers = await _route(
        picker,
        authorization="Bearer sk-chat",
        **{"x-gateway-inference-objective": "batch",
           "x-gateway-inference-fairness-id": "user-7"},
    )  # fmt: skip
    assert not _parsed(answers[0]).HasField("immediate_response")  # routed
    caller = exchange.ticket.caller
    assert (caller.tenant.name, caller.priority, caller.flow) == ("chat-app", -2, "chat-app/user-7")
    exchange.close()
    exchange, _ = await _route(
        picker, authorization="Bearer sk-chat", **{"x-gateway-inference-objective": "unknown"}
    )
    assert exchange.ticket.caller.priority == 10  # an unknown objective changes nothing
    exchange.close()


async def test_a_quota_holds_through_the_picker_with_openais_headers():
    picker = _picker()
    # quotas count UTC minutes: start early in one, so the test ends in it too
    await eventually(lambda: time.time() % 60 < 45, 20, "the start of a minute")
    first, _ = await _route(picker, authorization="Bearer sk-m")
    first.close()
    _, (answer,) = await _route(picker, authorization="Bearer sk-m")
    assert answer.immediate_response.status.code == 429
    sent = {h.header.key: h.header.raw_value.decode()
            for h in answer.immediate_response.headers.set_headers}  # fmt: skip
    assert sent["x-ratelimit-limit-requests"] == "1"
    assert int(sent["retry-after"] if "retry-after" in sent else sent["Retry-After"]) >= 1
