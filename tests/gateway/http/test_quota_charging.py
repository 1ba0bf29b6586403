"""How a tenant's quota is charged, against hostile clients and replicas on loopback: the
answer's maximum reserved at admission (per minute and against the fallback's daily
budget), what was served charged when the client leaves, token-id prompts counted, usage
asked of every stream (and the usage event the client did not ask for dropped), figures an
upstream sends validated, and which client headers reach the paid fallback API."""

from __future__ import annotations

import concurrent.futures
import json
import socket

import httpx
import pytest
from kubellm.gateway.discovery.base import FallbackTarget
from kubellm.gateway.routing.flow import tenants
from kubellm.gateway.routing.flow.controller import TenancySettings
from kubellm.gateway.routing.settings import FlowSettings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kubellm.api import SLO
from tests.fixtures.polling import wait_until
from tests.fixtures.servers import ServerThread
from tests.gateway.conftest import model
from tests.gateway.http.test_tenancy import within_one_minute

KEY = "sk-meter"


def settings(**row: object) -> TenancySettings:
    doc = {"tenants": [{"name": "meter", "apiKeys": [f"sha256:{tenants.digest(KEY)}"], **row}]}
    return TenancySettings(tenants.parse(doc), FlowSettings(ttl_seconds=30))


def post(gw, body: dict, path: str = "/v1/chat/completions", **headers: str) -> httpx.Response:
    return httpx.post(
        f"{gw.url}{path}",
        json={"model": "tiny", **body},
        headers={"authorization": f"Bearer {KEY}", **headers},
        timeout=60,
    )


def served(gw, route: str = "replica") -> float:
    return sum(
        gw.metric("kubellm_gateway_tenant_tokens_total", tenant="meter", target=route, kind=k)
        for k in ("prompt", "completion")
    )


HELLO = {"messages": [{"role": "user", "content": "hello"}]}


def test_concurrent_requests_reserve_their_max_tokens(engines, gateway):
    """tokensPerMinute 1,000; 20 requests at once, each may answer 300 tokens (and does):
    reserving only the prompt admitted all 20 (6,060 tokens in the minute, 6x); reserving
    prompt + max_tokens admits what fits, and what they were served stays within the quota."""
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 300
    engine.behaviour.token_delay = 0.002
    gw = gateway({"tiny": model("tiny", [server])}, tenancy=settings(tokensPerMinute=1000))
    within_one_minute()
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: post(gw, {**HELLO, "max_tokens": 300}), range(20)))
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 429}
    assert 429 in codes
    wait_until(lambda: served(gw) == 303 * codes.count(200), 30, "the answers counted")
    assert served(gw) <= 1000


def test_an_abandoned_non_streamed_request_is_charged_what_was_served(engines, gateway):
    """A non-streamed request reaches the replica, which streams slowly; the client leaves.
    It was refunded whole (nothing counted); now its prompt and the tokens that came back
    are charged to the tenant (assembled from a stream: forwarded whole, by default, only the
    prompt is known to have been served)."""
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 200
    engine.behaviour.token_delay = 0.1
    gw = gateway(
        {"tiny": model("tiny", [server])},
        tenancy=settings(tokensPerMinute=100000),
        assemble_non_streamed=True,
    )
    body = json.dumps({"model": "tiny", "max_tokens": 200, **HELLO}).encode()
    port = int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: engine.active == 1, 30, "the replica streaming")
    wait_until(lambda: engine.cancelled == 1, 30, "the replica's stream cancelled")
    labels = {"tenant": "meter", "target": "replica", "code": "499"}
    wait_until(lambda: gw.metric("kubellm_gateway_tenant_requests_total", **labels) == 1, 30)
    assert gw.metric(
        "kubellm_gateway_tenant_tokens_total", tenant="meter", target="replica", kind="prompt"
    ) >= 1  # fmt: skip


class UsageEngine:
    """A replica (or fallback API) that answers one token and reports `usage` as given:
    honest (the prompt's ids counted, or the given figures), or hostile (negative,
    infinite). Records the bodies and headers it received."""

    def __init__(self, usage: dict | None = None, raw_usage: str | None = None) -> None:
        self.usage = usage
        self.raw_usage = raw_usage  # JSON text put as is (Infinity, 1e999)
        self.bodies: list[dict] = []
        self.headers: list[dict] = []

    def _usage(self, body: dict) -> str:
        if self.raw_usage is not None:
            return self.raw_usage
        if self.usage is not None:
            return json.dumps(self.usage)
        prompt = body.get("prompt")
        ids = prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], list) else []
        return json.dumps({"prompt_tokens": len(ids) or 3, "completion_tokens": 1})

    async def complete(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        chat = request.url.path.endswith("chat/completions")
        usage = self._usage(body)
        choice = {"index": 0, "finish_reason": "stop"}
        if chat:
            choice["delta" if body.get("stream") else "message"] = {
                "role": "assistant",
                "content": "hi",
            }
        else:
            choice["text"] = "hi"
        head = f'"id":"x","object":"o","created":0,"model":"m","choices":[{json.dumps(choice)}]'
        if not body.get("stream"):
            text = "{" + head + f',"usage":{usage}' + "}"
            return Response(text, media_type="application/json")
        events = [
            "data: {" + head + "}\n\n",
            *(
                ['data: {"id":"x","object":"o","created":0,"model":"m","choices":[],'
                 f'"usage":{usage}}}\n\n']
                if (body.get("stream_options") or {}).get("include_usage") else []
            ),
            "data: [DONE]\n\n",
        ]  # fmt: skip
        return StreamingResponse(iter(events), media_type="text/event-stream")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.complete, methods=["POST"]),
                Route("/v1/completions", self.complete, methods=["POST"]),
                Route("/health", lambda r: JSONResponse({})),
                Route("/metrics", lambda r: Response("", media_type="text/plain")),
            ]
        )


@pytest.fixture
def usage_engine():
    started: list[ServerThread] = []

    def start(**kw: object) -> tuple[UsageEngine, ServerThread]:
        engine = UsageEngine(**kw)  # type: ignore[arg-type]
        server = ServerThread(engine.app()).start()
        started.append(server)
        return engine, server

    yield start
    for server in started:
        server.stop()


def test_token_id_prompts_are_counted_by_their_ids(usage_engine, gateway):
    """A prompt of 2,000 token ids (`[[ids]]`) was estimated at one token, and a stream
    without `include_usage` settled on that estimate, so a tenant of 1,000 tokens a minute
    streamed any number of them; each is now 2,000 tokens (the first of a minute still
    fits, the next does not). A flat `[ids]` prompt counts its ids too."""
    _engine, server = usage_engine()
    gw = gateway({"tiny": model("tiny", [server])}, tenancy=settings(tokensPerMinute=1000))
    within_one_minute()
    ids = list(range(1, 2001))
    nested = {"prompt": [ids], "max_tokens": 1, "stream": True}
    assert post(gw, nested, "/v1/completions").status_code == 200
    refused = post(gw, nested, "/v1/completions")
    assert refused.status_code == 429
    assert refused.headers["x-ratelimit-limit-tokens"] == "1000"
    assert post(gw, {"prompt": ids, "max_tokens": 1}, "/v1/completions").status_code == 429


def test_every_stream_asks_for_usage_and_the_client_sees_only_what_it_asked(usage_engine, gateway):
    """A stream without `include_usage`: the replica is asked for usage (settled on it: the
    2,000 ids, not an estimate) and the usage event is dropped from the client's stream; a
    client that asked gets it."""
    engine, server = usage_engine()
    gw = gateway({"tiny": model("tiny", [server])}, tenancy=settings(tokensPerMinute=10**6))
    ids = list(range(1, 2001))
    plain = post(gw, {"prompt": [ids], "max_tokens": 1, "stream": True}, "/v1/completions")
    assert plain.status_code == 200
    assert engine.bodies[-1]["stream_options"] == {"include_usage": True}
    assert '"usage"' not in plain.text and plain.text.rstrip().endswith("data: [DONE]")
    wait_until(lambda: served(gw) == 2001, 30, "the stream settled on its usage")
    asked = post(
        gw,
        {"prompt": [ids], "stream": True, "stream_options": {"include_usage": True}},
        "/v1/completions",
    )
    assert '"prompt_tokens": 2000' in asked.text or '"prompt_tokens":2000' in asked.text
    wait_until(lambda: served(gw) == 4002, 30, "the second settled")


@pytest.mark.parametrize(
    "usage",
    ['{"prompt_tokens": -5, "completion_tokens": -7}', '{"prompt_tokens": 1e999}',
     '{"prompt_tokens": Infinity, "completion_tokens": NaN}',
     '{"prompt_tokens": 3.5, "completion_tokens": true}'],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_hostile_usage_figures_leave_a_good_answer_and_no_pending_request(
    usage_engine, gateway, usage, stream
):
    """A replica and the fallback report usage figures that are negative, infinite, not a
    number or not integers: the answer is still a 200, nothing stays pending, and the
    tenant's counters take the gateway's own estimate instead."""
    _engine, server = usage_engine(raw_usage=usage)
    _api, api_server = usage_engine(raw_usage=usage)
    fallback = FallbackTarget(url=f"{api_server.url}/v1", model="ext", api_key="sk-fb")
    gw = gateway(
        {"tiny": model("tiny", [server], fallback=fallback)},
        tenancy=settings(tokensPerMinute=10**6, fallback={"tokensPerDay": 10**6}),
    )
    body = {**HELLO, "max_tokens": 5, "stream": stream}
    assert post(gw, body).status_code == 200
    gw.update({"tiny": model("tiny", [], fallback=fallback)})
    answer = post(gw, body)
    assert answer.status_code == 200 and answer.headers["x-kubellm-route"] == "fallback"
    names = {"model": "tiny", "deployment": "tiny", "namespace": "default"}
    pending = "kubellm_gateway_pending_requests"
    wait_until(lambda: gw.metric(pending, **names) == 0, 30, "no request pending")
    for route in ("replica", "fallback"):
        wait_until(lambda route=route: served(gw, route) >= 1, 30, f"{route} tokens counted")


def test_a_burst_spends_no_more_than_the_fallback_budget(engines, gateway):
    """The pool is saturated; a tenant with a fallback budget of 1,000 tokens a day sends 10
    requests at once, each may answer 300 tokens (and does): the budget was checked `> 0`
    at admission only, so all 10 went (3,030 tokens); each now reserves its maximum
    against the budget before it is sent, and the rest wait for a replica."""
    (engine, server), (api, api_server) = engines(2)
    engine.behaviour.waiting = 50
    api.behaviour.tokens = 300
    api.behaviour.token_delay = 0.002
    fallback = FallbackTarget(url=f"{api_server.url}/v1", model="ext", api_key="sk-fb")
    gw = gateway(
        {"tiny": model("tiny", [server], fallback=fallback, slo=SLO(ttft_seconds=0.5))},
        tenancy=settings(fallback={"tokensPerDay": 1000}),
    )
    wait_until(lambda: gw.gateway.load.stats(server.url) is not None, 30, "a scrape")
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: post(gw, {**HELLO, "max_tokens": 300}), range(10)))
    routes = [a.headers.get("x-kubellm-route") for a in answers]
    assert 1 <= routes.count("fallback") <= 3, routes
    wait_until(lambda: served(gw, "fallback") == 303 * routes.count("fallback"), 30)
    assert served(gw, "fallback") <= 1000
    assert len(api.bodies) == routes.count("fallback")


def test_the_fallback_gets_only_allowed_client_headers(engines, gateway):
    """The client's `openai-organization` and `openai-project` would bill or steer the
    platform's account at the paid API: they are not sent there (the platform's key is);
    the request id and `accept` are."""
    ((api, api_server),) = engines(1)
    fallback = FallbackTarget(url=f"{api_server.url}/v1", model="ext", api_key="sk-fb")
    gw = gateway({"tiny": model("tiny", [], fallback=fallback)})
    answer = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "tiny", **HELLO},
        headers={"openai-organization": "org-victim", "openai-project": "proj-victim",
                 "x-request-id": "req-1", "accept": "application/json"},
        timeout=60,
    )  # fmt: skip
    assert answer.status_code == 200 and answer.headers["x-kubellm-route"] == "fallback"
    (sent,) = api.headers
    assert "openai-organization" not in sent and "openai-project" not in sent
    assert sent["authorization"] == "Bearer sk-fb"
    assert sent["x-request-id"] == "req-1" and sent["accept"] == "application/json"
