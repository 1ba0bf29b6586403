"""Tenants through the HTTP gateway over fake engines on loopback: keys and the default
tenant, quotas answered with 429 and OpenAI's headers, a `never` tenant that reaches no
fallback however saturated the pool, the headroom kept for high bands, usage per tenant."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import replace

import httpx
import openai
import pytest
from kubellm.gateway.discovery.base import FallbackTarget
from kubellm.gateway.routing.flow import tenants
from kubellm.gateway.routing.flow.controller import TenancySettings
from kubellm.gateway.routing.settings import FlowSettings, Thresholds
from prometheus_client import generate_latest

from kubellm.api import SLO
from tests.fixtures.polling import wait_until
from tests.gateway.conftest import model


def within_one_minute() -> None:
    """Quotas count UTC minutes: start a quota test early in one, so it ends in it too."""
    wait_until(lambda: time.time() % 60 < 45, 20, "the start of a minute")


KEYS = {"chat-app": "sk-chat", "nightly-eval": "sk-eval", "resident": "sk-res", "meter": "sk-m"}


def declared(default: str | None = None, **changes: dict) -> TenancySettings:
    rows = [
        {"name": "chat-app", "priority": 10},
        {"name": "nightly-eval", "priority": -1, "fallback": "never"},
        {"name": "resident", "priority": 5, "fallback": "never"},
        {"name": "meter", "priority": 0, "requestsPerMinute": 2},
    ]
    for row in rows:
        row["apiKeys"] = [f"sha256:{tenants.digest(KEYS[row['name']])}"]
        row.update(changes.get(row["name"], {}))
    doc = {"tenants": rows, **({"default": default} if default else {})}
    return TenancySettings(tenants.parse(doc), FlowSettings(ttl_seconds=0.3, headroom_load=2))


def chat(gw, tenant: str | None, text: str = "hello", **kw):
    headers = {"authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], **kw}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=20)


def test_keys_name_the_tenant_keyless_is_the_default_or_401(engines, gateway):
    ((_engine, server),) = engines(1)
    gw = gateway({"tiny": model("tiny", [server])}, tenancy=declared())
    assert chat(gw, "chat-app").status_code == 200
    refused = chat(gw, None)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
        headers={"authorization": "Bearer sk-nobody"},
    )
    assert wrong.status_code == 401
    bad = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
        headers={"authorization": "Bearer sk-chat", "x-kubellm-priority": "urgent"},
    )
    assert bad.status_code == 400 and "x-kubellm-priority" in bad.json()["error"]["message"]

    gw2 = gateway({"tiny": model("tiny", [server])}, tenancy=declared(default="resident"))
    assert chat(gw2, None).status_code == 200
    assert gw2.metric(
        "kubellm_gateway_tenant_requests_total", tenant="resident", target="replica", code="200"
    ) == 1  # fmt: skip


def test_a_tenant_over_its_requests_per_minute_gets_429_with_openai_headers(engines, gateway):
    ((engine, server),) = engines(1)
    gw = gateway({"tiny": model("tiny", [server])}, tenancy=declared())
    within_one_minute()
    assert [chat(gw, "meter").status_code for _ in range(2)] == [200, 200]
    refused = chat(gw, "meter")
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    assert chat(gw, "chat-app").status_code == 200  # the others are not throttled
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEYS["meter"], max_retries=0)
    with pytest.raises(openai.RateLimitError):  # the official client reads it as such
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert (
        gw.metric("kubellm_gateway_tenant_throttled_total", tenant="meter", limit="requests") == 2
    )
    assert len(engine.bodies) == 3


def test_a_never_tenant_reaches_no_fallback_however_saturated(engines, gateway):
    """The pool is saturated (the engine reports a deep queue) and then gone (no replica):
    the allowed tenant's requests go to the fallback, the `never` tenants' never do (a
    sheddable one is dropped when its band's TTL runs out, a resident one when its TTFT
    budget does); the capturing fallback server sees only the allowed tenant's prompts."""
    (engine, server), (api, api_server) = engines(2)
    engine.behaviour.waiting = 50
    fallback = FallbackTarget(url=f"{api_server.url}/v1", model="ext", api_key="sk-fb")
    models = {"tiny": model("tiny", [server], fallback=fallback, slo=SLO(ttft_seconds=0.2))}
    gw = gateway(models, tenancy=declared(), zero_replica_wait_seconds=0.3)
    wait_until(lambda: gw.gateway.load.stats(server.url) is not None, 5, "a scrape")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = {
            (tenant, i): pool.submit(chat, gw, tenant, f"from {tenant} {i}")
            for tenant in ("chat-app", "nightly-eval", "resident")
            for i in range(4)
        }
        statuses = {key: f.result(timeout=20) for key, f in answers.items()}
    assert {s.status_code for (t, _), s in statuses.items() if t == "chat-app"} == {200}
    assert all(s.headers["x-kubellm-route"] == "fallback"
               for (t, _), s in statuses.items() if t == "chat-app")  # fmt: skip
    for (tenant, _), answer in statuses.items():
        if tenant != "chat-app":
            assert answer.status_code == 429, answer.text
    evals = [s for (t, _), s in statuses.items() if t == "nightly-eval"]
    assert {s.headers["x-kubellm-drop-reason"] for s in evals} == {"ttl"}

    gw.update({"tiny": model("tiny", [], fallback=fallback, slo=SLO(ttft_seconds=0.2))})
    for tenant in ("nightly-eval", "resident"):
        assert chat(gw, tenant, f"from {tenant} again").status_code in (429, 503)
    assert chat(gw, "chat-app", "from chat-app again").status_code == 200

    seen = [body["messages"][0]["content"] for body in api.bodies]
    assert len(seen) == 5
    assert all(text.startswith("from chat-app") for text in seen), seen
    assert engine.bodies == []
    assert gw.metric(
        "kubellm_gateway_tenant_dropped_total", tenant="nightly-eval", reason="ttl"
    ) >= 4  # fmt: skip


def _stream(gw, tenant: str, text: str) -> int:
    with httpx.stream(
        "POST",
        f"{gw.url}/v1/chat/completions",
        json={"model": "tiny", "stream": True, "messages": [{"role": "user", "content": text}]},
        headers={"authorization": f"Bearer {KEYS[tenant]}"},
        timeout=20,
    ) as response:
        response.read()
        return response.status_code


def test_sheddable_work_stays_below_the_headroom_line(engines, gateway):
    """headroomLoad 2 of a replica's 4 slots: two batch streams run, the third waits (not
    at the fallback, which the batch tenant may use: the replica is not saturated, its room
    is kept); a chat request takes a free slot at once, past the waiting batch request."""
    (engine, server), (api, api_server) = engines(2)
    fallback = FallbackTarget(url=f"{api_server.url}/v1", model="ext", api_key="sk-fb")
    engine.behaviour.tokens = 40
    engine.behaviour.token_delay = 0.05  # each stream holds its slot about 2 s
    settings = declared(**{"nightly-eval": {"fallback": "allowed"}})
    settings = TenancySettings(settings.tenants, FlowSettings(ttl_seconds=30, headroom_load=2))
    gw = gateway(
        {"tiny": model("tiny", [server], fallback=fallback, slo=SLO(ttft_seconds=5))},
        tenancy=settings,
        thresholds=Thresholds(max_in_flight=4),
    )
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        batch = [pool.submit(_stream, gw, "nightly-eval", f"batch {i}") for i in range(3)]
        wait_until(lambda: engine.active == 2, 5, "two batch streams")
        flow = gw.gateway.scheduler.tenancy.flows["tiny"]
        wait_until(lambda: len(flow) == 1, 5, "the third batch request queued")
        assert engine.active == 2  # the line holds it back though two slots are free
        interactive = pool.submit(_stream, gw, "chat-app", "chat")
        wait_until(lambda: len(engine.bodies) == 3, 5, "the chat request at the engine")
        assert engine.bodies[-1]["messages"][0]["content"] == "chat"
        assert len(flow) == 1  # the batch request still waits
        assert interactive.result(timeout=20) == 200
        assert [f.result(timeout=30) for f in batch] == [200, 200, 200]
    contents = [b["messages"][0]["content"] for b in engine.bodies]
    assert contents[2] == "chat" and contents[3].startswith("batch")  # it went past
    assert api.bodies == []


def test_sheddable_work_waits_while_a_chat_on_the_replica_awaits_its_first_token(engines, gateway):
    """The prefill hold: a chat stream sent to the replica holds batch requests off it until
    its first token (the replica is below the headroom line: only the hold stops them),
    then the waiting batch request goes there. Off (`hold_prefill=False`), it goes at once."""
    (engine, server), (other, other_server) = engines(2)
    engine.behaviour.first_byte_delay = 1.0  # the chat's "prefill"
    flow_settings = FlowSettings(ttl_seconds=30, headroom_load=2)
    settings = TenancySettings(declared().tenants, flow_settings)
    gw = gateway(
        {"tiny": model("tiny", [server], slo=SLO(ttft_seconds=5))},
        tenancy=settings,
        thresholds=Thresholds(max_in_flight=4),
    )
    scheduler = gw.gateway.scheduler
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        interactive = pool.submit(_stream, gw, "chat-app", "chat")
        wait_until(lambda: len(engine.bodies) == 1, 5, "the chat at the engine")
        assert scheduler.flow.prefilling == {server.url: 1}
        batch = pool.submit(chat, gw, "nightly-eval", "batch")
        flow = scheduler.tenancy.flows["tiny"]
        wait_until(lambda: len(flow) == 1, 5, "the batch request held at the gateway")
        assert len(engine.bodies) == 1
        assert interactive.result(timeout=20) == 200  # its first token: the hold ends
        assert batch.result(timeout=20).status_code == 200
    assert [b["messages"][0]["content"] for b in engine.bodies] == ["chat", "batch"]
    assert scheduler.flow.prefilling == {}

    other.behaviour.first_byte_delay = 3.0  # long enough to see the batch go beside it
    off = TenancySettings(declared().tenants, replace(flow_settings, hold_prefill=False))
    gw = gateway(
        {"tiny": model("tiny", [other_server], slo=SLO(ttft_seconds=5))},
        tenancy=off,
        thresholds=Thresholds(max_in_flight=4),
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        interactive = pool.submit(_stream, gw, "chat-app", "chat")
        wait_until(lambda: len(other.bodies) == 1, 5, "the chat at the engine")
        batch = pool.submit(chat, gw, "nightly-eval", "batch")
        wait_until(lambda: len(other.bodies) == 2, 5, "the batch request sent beside it")
        assert not interactive.done()  # the chat had not begun to answer
        assert interactive.result(timeout=20) == 200
        assert batch.result(timeout=20).status_code == 200
    assert gw.gateway.scheduler.flow.prefilling == {}


def test_sheddable_prompts_reach_a_replica_one_at_a_time_under_the_prefill_budget(engines, gateway):
    """headroomPrefillRate 10 tokens/s: the first batch request (a ~40-token prompt) goes at
    once and owes the replica 4 s of prefill; the second waits at the gateway though
    the replica is below the line, and goes when that has drained. A chat request does not
    wait for it."""
    (engine, server), *_ = engines(1)
    engine.behaviour.tokens = 40
    engine.behaviour.token_delay = 0.05  # each stream holds its slot about 2 s
    flow_settings = FlowSettings(ttl_seconds=30, headroom_load=3, headroom_prefill_rate=10)
    gw = gateway(
        {"tiny": model("tiny", [server], slo=SLO(ttft_seconds=5))},
        tenancy=TenancySettings(declared().tenants, flow_settings),
        thresholds=Thresholds(max_in_flight=4),
    )
    flow = gw.gateway.scheduler.tenancy.flows
    prompt = "b" * 160  # 40 tokens by the gateway's estimate
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(_stream, gw, "nightly-eval", f"1 {prompt}")
        wait_until(lambda: len(engine.bodies) == 1, 5, "the first batch request sent")
        second = pool.submit(_stream, gw, "nightly-eval", f"2 {prompt}")
        wait_until(lambda: len(flow["tiny"]) == 1, 5, "the second held by the budget")
        assert len(engine.bodies) == 1  # one in flight of a line of 3: only the debt holds it
        interactive = pool.submit(_stream, gw, "chat-app", "chat")
        wait_until(lambda: len(engine.bodies) == 2, 5, "the chat request past it")
        assert engine.bodies[1]["messages"][0]["content"] == "chat"
        wait_until(lambda: len(engine.bodies) == 3, 10, "the second batch request, drained")
        assert [f.result(timeout=30) for f in (first, second, interactive)] == [200] * 3
    assert engine.bodies[2]["messages"][0]["content"].startswith("2 ")


def test_usage_is_counted_per_tenant(engines, gateway):
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 6
    gw = gateway({"tiny": model("tiny", [server])}, tenancy=declared())
    assert chat(gw, "chat-app").status_code == 200  # JSON: usage 3 prompt + 6 completion
    assert _stream(gw, "resident", "x") == 200  # a stream: 6 events with text
    m = gw.metric
    assert m("kubellm_gateway_tenant_tokens_total", tenant="chat-app", target="replica",
             kind="completion") == 6  # fmt: skip
    assert m("kubellm_gateway_tenant_tokens_total", tenant="chat-app", target="replica",
             kind="prompt") == 3  # fmt: skip
    wait_until(
        lambda: m("kubellm_gateway_tenant_tokens_total", tenant="resident", target="replica",
                  kind="completion") == 6,
        5,
    )  # fmt: skip
    assert m("kubellm_gateway_tenant_queue_seconds_count", tenant="chat-app") == 1
    assert m("kubellm_gateway_tenant_slo_met_requests_total", tenant="chat-app") == 1
    assert m("kubellm_gateway_tenant_tokens_total", tenant="nightly-eval", target="fallback",
             kind="prompt") == 0  # declared tenants show at 0  # fmt: skip
    text = generate_latest(gw.gateway.metrics.registry).decode()  # (metrics port)
    assert (
        'kubellm_gateway_tenant_tokens_total{kind="prompt",target="fallback",'
        'tenant="nightly-eval"} 0.0' in text
    )


def test_ttft_and_itl_are_counted_per_tenant_as_the_models_series_count_them(engines, gateway):
    """Each tenant's TTFT histogram holds the same observations as the model's (a JSON
    answer's whole time, a stream's first event), its ITL histogram a stream's gaps; a
    refused request counts in neither; every declared tenant's series shows at 0."""
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 6
    gw = gateway({"tiny": model("tiny", [server])}, tenancy=declared())
    assert chat(gw, "chat-app").status_code == 200
    assert _stream(gw, "resident", "x") == 200
    assert chat(gw, None).status_code == 401
    m = gw.metric
    ttft, itl = (
        "kubellm_gateway_tenant_time_to_first_token_seconds",
        ("kubellm_gateway_tenant_inter_token_latency_seconds"),
    )
    wait_until(lambda: m(f"{ttft}_count", tenant="resident") == 1, 5, "the stream counted")
    assert m(f"{ttft}_count", tenant="chat-app") == 1
    assert m(f"{itl}_count", tenant="chat-app") == 0  # a JSON answer has no gaps
    assert m(f"{itl}_count", tenant="resident") == 5  # 6 events carrying text: 5 gaps
    names = {"model": "tiny", "deployment": "tiny", "namespace": "default"}
    model_ttft = gw.gateway.metrics.registry.get_sample_value(
        "kubellm_gateway_time_to_first_token_seconds_sum", names
    )
    per_tenant = m(f"{ttft}_sum", tenant="chat-app") + m(f"{ttft}_sum", tenant="resident")
    assert model_ttft is not None and per_tenant == pytest.approx(model_ttft)
    model_gaps = gw.gateway.metrics.registry.get_sample_value(
        "kubellm_gateway_inter_token_latency_seconds_sum", names
    )
    assert m(f"{itl}_sum", tenant="resident") == pytest.approx(model_gaps)
    text = generate_latest(gw.gateway.metrics.registry).decode()  # (metrics port)
    assert f'{ttft}_count{{tenant="nightly-eval"}} 0.0' in text
    assert 'tenant=""' not in text  # no series for a caller without a tenant


def test_waiting_requests_dispatch_by_band_and_a_header_only_lowers(engines, gateway):
    """One slot, held: a priority-0 request queues first, then a chat request (10), then a
    chat request that lowered itself to -5 with x-kubellm-priority. The slot frees: the
    chat request goes first, the priority-0 one next, the lowered one last."""
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 20
    engine.behaviour.token_delay = 0.05
    gw = gateway(
        {"tiny": model("tiny", [server], slo=SLO(ttft_seconds=20))},
        tenancy=TenancySettings(declared().tenants, FlowSettings(ttl_seconds=30)),
        thresholds=Thresholds(max_in_flight=1),
    )
    flow = gw.gateway.scheduler.tenancy.flow("tiny")

    def lowered() -> int:
        return httpx.post(
            f"{gw.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "lowered"}]},
            headers={"authorization": f"Bearer {KEYS['chat-app']}", "x-kubellm-priority": "-5"},
            timeout=30,
        ).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = pool.submit(_stream, gw, "resident", "held")
        wait_until(lambda: engine.active == 1, 5, "the held stream")
        first = pool.submit(_stream, gw, "meter", "zero")  # its 1 of 2 requests a minute
        wait_until(lambda: len(flow) == 1, 5, "the priority-0 request queued")
        second = pool.submit(_stream, gw, "chat-app", "ten")
        third = pool.submit(lowered)
        wait_until(lambda: len(flow) == 3, 5, "three queued")
        assert [f.result(timeout=30) for f in (held, first, second, third)] == [200] * 4
    assert [b["messages"][0]["content"] for b in engine.bodies] == ["held", "ten", "zero",
                                                                    "lowered"]  # fmt: skip


def test_a_token_quota_settles_to_usage_and_a_refusal_frees_nothing(engines, gateway):
    """tokensPerMinute 50: the first request (reserving 100 prompt tokens by the estimate
    and its max_tokens 4; the first of a minute always fits) is settled to its usage
    (3 + 4); the next two (104 each) do not fit, and a refused one gives back nothing it
    was not charged."""
    ((_engine, server),) = engines(1)
    gw = gateway(
        {"tiny": model("tiny", [server])},
        tenancy=declared(meter={"requestsPerMinute": 100, "tokensPerMinute": 50}),
    )
    text = "x" * 400  # ~100 tokens by the estimate
    within_one_minute()
    assert chat(gw, "meter", text, max_tokens=4).status_code == 200
    second = chat(gw, "meter", text, max_tokens=4)
    assert second.status_code == 429
    assert second.headers["x-ratelimit-limit-tokens"] == "50"
    assert second.headers["x-ratelimit-remaining-tokens"] in {"43", "0"}  # settled or not yet
    assert chat(gw, "meter", text, max_tokens=4).status_code == 429
    assert chat(gw, "meter", "short", max_tokens=4).status_code == 200  # 7 + 1 + 4 fits within 50
    assert gw.metric("kubellm_gateway_tenant_throttled_total", tenant="meter", limit="tokens") == 2


def test_fallback_capacity_under_contention_goes_by_band(engines, gateway):
    """The pool is saturated and the fallback takes one request at a time. A `never`
    tenant's request (priority 5) waits for a replica; a priority-0 request waits for the
    fallback, then a chat request (10); when the slot frees, the chat request takes it,
    then the priority-0 one (the never tenant holds neither back from the fallback)."""
    (engine, server), (api, api_server) = engines(2)
    engine.behaviour.waiting = 50
    api.behaviour.tokens = 20
    api.behaviour.token_delay = 0.1  # each fallback answer holds the slot ~2 s
    fallback = FallbackTarget(
        url=f"{api_server.url}/v1", model="ext", api_key="sk-fb", max_concurrency=1
    )
    gw = gateway(
        {"tiny": model("tiny", [server], fallback=fallback, slo=SLO(ttft_seconds=8))},
        tenancy=TenancySettings(declared().tenants, FlowSettings(ttl_seconds=30)),
    )
    wait_until(lambda: gw.gateway.load.stats(server.url) is not None, 5, "a scrape")
    flow = gw.gateway.scheduler.tenancy.flow("tiny")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = pool.submit(_stream, gw, "resident", "held")  # never: it waits, then 429
        wait_until(lambda: len(flow) == 1, 5, "the never tenant waiting")
        first = pool.submit(_stream, gw, "chat-app", "first")
        wait_until(lambda: api.active == 1, 5, "the fallback busy")
        zero = pool.submit(_stream, gw, "meter", "zero")
        wait_until(lambda: len(flow) == 2, 5, "the priority-0 request waiting")
        ten = pool.submit(_stream, gw, "chat-app", "ten")
        wait_until(lambda: len(flow) == 3, 5, "the chat request waiting")
        wait_until(lambda: len(api.bodies) == 3, 10, "the third fallback request")
        assert not held.done()  # the never tenant still waits: it held nobody back
        assert [f.result(timeout=30) for f in (first, zero, ten)] == [200, 200, 200]
        assert held.result(timeout=60) == 429
    assert [b["messages"][0]["content"] for b in api.bodies] == ["first", "ten", "zero"]


def test_a_tenant_at_its_fair_in_flight_share_waits_while_the_replica_has_room(engines, gateway):
    """The fair in-flight budget, 1,042 service tokens per replica: the light tenant's
    requests (about 21 each: prompt + 2 x max_tokens 10) keep what they ask; the big tenant
    (100-token prompts, max_tokens 200: about 500 each) may have the rest, 1,021, so with
    two in flight its third waits at the gateway though the replica has five free slots; a
    second request of the light tenant goes past it at once (the big one's share is then
    1,000); the third goes when one of the big tenant's ends. Without the budget all go."""
    (engine, server), (other, other_server) = engines(2)
    for e in (engine, other):
        e.behaviour.tokens = 40
        e.behaviour.token_delay = 0.1  # each answer holds its slot about 4 s
    same_band = declared(**{"chat-app": {"priority": 0}, "resident": {"priority": 0}}).tenants
    budget = FlowSettings(ttl_seconds=30, fair_in_flight_tokens=1042)
    gw = gateway(
        {"tiny": model("tiny", [server], slo=SLO(ttft_seconds=20))},
        tenancy=TenancySettings(same_band, budget),
        thresholds=Thresholds(max_in_flight=8),
    )
    flow = gw.gateway.scheduler.tenancy.flow("tiny")
    text = "x" * 397  # with "bN ": 400 characters, 100 tokens by the gateway's estimate

    def sent() -> list[str]:
        return [b["messages"][0]["content"][:2] for b in engine.bodies]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        light = [pool.submit(chat, gw, "resident", "s1", max_tokens=10)]
        wait_until(lambda: len(engine.bodies) == 1, 5, "the light tenant's request")
        big = [pool.submit(chat, gw, "chat-app", f"b{i} {text}", max_tokens=200) for i in (1, 2)]
        wait_until(lambda: len(engine.bodies) == 3, 5, "two of the big tenant's")
        big.append(pool.submit(chat, gw, "chat-app", f"b3 {text}", max_tokens=200))
        wait_until(lambda: len(flow) == 1, 5, "the third held at the gateway")
        assert len(engine.bodies) == 3  # 3 of 8 slots taken: only its share holds it
        light.append(pool.submit(chat, gw, "resident", "s2", max_tokens=10))
        wait_until(lambda: "s2" in sent(), 5, "the light tenant's second, past it")
        assert "b3" not in sent() and len(flow) == 1
        assert [f.result(timeout=30).status_code for f in light + big] == [200] * 5
    assert sent()[-1] == "b3"
    assert flow.in_flight == {}  # every end released its service

    gw = gateway(
        {"tiny": model("tiny", [other_server], slo=SLO(ttft_seconds=20))},
        tenancy=TenancySettings(same_band, FlowSettings(ttl_seconds=30)),
        thresholds=Thresholds(max_in_flight=8),
    )
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, gw, "resident", "s1", max_tokens=10)]
        wait_until(lambda: len(other.bodies) == 1, 5, "the light tenant's request")
        futures += [
            pool.submit(chat, gw, "chat-app", f"b{i} {text}", max_tokens=200) for i in (1, 2, 3)
        ]
        wait_until(lambda: len(other.bodies) == 4, 5, "all three sent at once")
        assert [f.result(timeout=30).status_code for f in futures] == [200] * 4


def test_a_request_without_max_tokens_counts_as_its_tenants_recent_answers(engines, gateway):
    """Issue 39 item 4: leaving `max_tokens` out does not make a request look cheap to the
    fair in-flight budget. After a 600-token answer, the tenant's next request without
    `max_tokens` holds at least 2 x 600 service tokens in flight (it held 2 x 256)."""
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 600
    gw = gateway(
        {"tiny": model("tiny", [server], slo=SLO(ttft_seconds=20))},
        tenancy=TenancySettings(declared().tenants, FlowSettings(ttl_seconds=30)),
    )
    flow = gw.gateway.scheduler.tenancy.flow("tiny")
    assert chat(gw, "chat-app", "first").status_code == 200
    engine.behaviour.tokens = 1
    engine.behaviour.first_byte_delay = 3  # the next one stays in flight a while
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        second = pool.submit(chat, gw, "chat-app", "second")
        wait_until(lambda: flow.in_flight.get(10), 10, "the second in flight")
        held = flow.in_flight[10]["chat-app"]
        assert second.result(timeout=30).status_code == 200
    assert held >= 2 * 600
