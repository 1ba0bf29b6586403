"""The shadow step on real loopback servers (gateway/routing/canary/mirror.py): a sample of the
stable revision's requests is mirrored to the canary, compared with the stable replica's
greedy answer, counted apart, never returned to a client, and shed when the canary is busy."""

from __future__ import annotations

from dataclasses import replace

from kubellm.gateway.discovery.base import CanarySplit, Endpoint
from kubellm.gateway.routing.canary import revisions
from kubellm.gateway.routing.router import routing_request
from kubellm.operator import figures, rollout
from prometheus_client import generate_latest

from kubellm import api, metrics
from tests.fixtures.engines import wait_until
from tests.gateway.conftest import model


def _target(stable, canary, share=1.0, concurrency=4):
    return replace(
        model("tiny", [stable, canary]),
        endpoints=(Endpoint(stable.url), Endpoint(canary.url, revision="new")),
        canary=CanarySplit("new", 1, share, concurrency, 4),
    )


def _stable_prompts(count: int) -> list[list[dict[str, str]]]:
    """Prompts whose split key falls on the stable side of a 1% canary."""
    out = []
    i = 0
    while len(out) < count:
        messages = [{"role": "user", "content": f"Question {i} of the mirror test. " * 20}]
        key = revisions.request_key(routing_request("tiny", {"messages": messages}, None))
        if not revisions.to_canary(key, 1):
            out.append(messages)
        i += 1
    return out


def _text(gw) -> str:
    return generate_latest(gw.gateway.metrics.registry).decode()


def _settled(gw, count: int) -> None:
    """Wait until `count` mirrors were compared or shed."""
    wait_until(lambda: _sum(_text(gw), metrics.GATEWAY_MIRROR_REQUESTS)
               + _sum(_text(gw), metrics.GATEWAY_MIRROR_SHED) >= count, timeout=60,
               what="every mirror compared or shed")  # fmt: skip


def _sum(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_mirrored_answers_are_compared_and_never_reach_the_client(engines, gateway):
    (stable_engine, stable), (canary_engine, canary) = engines(2, prefix="r")
    gw = gateway({"tiny": _target(stable, canary)})
    client = gw.client()
    for messages in _stable_prompts(6):
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=50)
        assert answer.choices[0].message.content.startswith("r0")  # the stable answer only
    _settled(gw, 6)
    text = _text(gw)
    compared = _sum(text, metrics.GATEWAY_MIRROR_REQUESTS, revision="new")
    assert compared >= 1
    assert _sum(text, metrics.GATEWAY_MIRROR_AGREED) == 0  # "r1-t0" is not "r0-t0"
    shadow = canary_engine.bodies[-1]  # the client's seeded draw, bounded, logprobs
    seeds = {b["messages"][0]["content"]: b["seed"] for b in stable_engine.bodies}
    assert (shadow["seed"], shadow["max_tokens"]) == (seeds[shadow["messages"][0]["content"]], 8)
    assert shadow["stream"] is False and shadow["logprobs"] is True
    # vLLM answers 400 to a body without its content type: the mirror says it's JSON
    assert canary_engine.headers[-1].get("content-type") == "application/json"
    # counted apart: the gateway's requests and the per-revision series hold the 6 only
    assert _sum(text, metrics.GATEWAY_REQUESTS) == 6
    counted = figures.parse(text, "tiny")
    assert counted["stable"].requests == 6 and counted.get("new", rollout.Counters()).requests == 0
    quality = api.RolloutAnalysis(minRequests=1, minClients=1, minClassRequests=1,
                                  quality={"minMirroredRequests": 1})  # fmt: skip
    verdict = rollout.quality_verdict(counted["new"], counted["stable"], quality, 4)
    assert verdict is not None and verdict.reason == "CanaryAnswersDiffer"


def test_identical_revisions_agree(engines, gateway):
    (_, stable), (canary_engine, canary) = engines(2, prefix="r")
    canary_engine.name = "r0"  # the same answers as the stable engine
    gw = gateway({"tiny": _target(stable, canary)})
    client = gw.client()
    for messages in _stable_prompts(4):
        client.chat.completions.create(model="tiny", messages=messages)
    _settled(gw, 4)
    text = _text(gw)
    compared = _sum(text, metrics.GATEWAY_MIRROR_REQUESTS)
    assert compared >= 1 and _sum(text, metrics.GATEWAY_MIRROR_AGREED) == compared
    assert _sum(text, metrics.GATEWAY_MIRROR_TOKENS_AGREED) == _sum(
        text, metrics.GATEWAY_MIRROR_TOKENS
    )


def test_the_mirror_is_shed_when_the_canary_is_busy_and_the_stable_answer_waits_for_nothing(
    engines, gateway
):
    (_, stable), (canary_engine, canary) = engines(2, prefix="r")
    canary_engine.behaviour.first_byte_delay = 30.0  # the canary hangs on every mirror
    gw = gateway({"tiny": _target(stable, canary, concurrency=2)})
    client = gw.client(timeout=20)
    for messages in _stable_prompts(10):  # each answered by stable, mirrors or not
        answer = client.chat.completions.create(model="tiny", messages=messages)
        assert answer.choices[0].message.content.startswith("r0")
    text = _text(gw)
    assert gw.gateway.mirror.in_flight <= 2
    assert _sum(text, metrics.GATEWAY_MIRROR_SHED, reason="busy") >= 8
    assert len(canary_engine.bodies) <= 2


def test_mirrors_never_count_against_a_tenants_quota(engines, gateway):
    from tests.gateway.http.test_tenancy import chat, declared, within_one_minute

    (_, stable), (_, canary) = engines(2, prefix="r")
    gw = gateway({"tiny": _target(stable, canary)}, tenancy=declared())  # meter: 2 a minute
    within_one_minute()
    prompts = [m[0]["content"] for m in _stable_prompts(2)]
    assert [chat(gw, "meter", text).status_code for text in prompts] == [200, 200]
    wait_until(lambda: _sum(_text(gw), metrics.GATEWAY_MIRROR_REQUESTS) >= 1, timeout=60,
               what="a mirror compared")  # fmt: skip
    text = _text(gw)
    assert _sum(text, "kubellm_gateway_tenant_requests_total", tenant="meter") == 2
    assert _sum(text, "kubellm_gateway_tenant_throttled_total", tenant="meter") == 0


def test_a_shadow_step_mirrors_while_the_canary_takes_no_request(engines, gateway):
    (_, stable), (canary_engine, canary) = engines(2, prefix="r")
    target = _target(stable, canary)
    target = replace(target, canary=replace(target.canary, weight=0))  # the shadow step
    gw = gateway({"tiny": target})
    client = gw.client()
    for i in range(6):  # any prompt: at weight 0 none is the canary's
        messages = [{"role": "user", "content": f"Shadow step question {i}. " * 20}]
        answer = client.chat.completions.create(model="tiny", messages=messages)
        assert answer.choices[0].message.content.startswith("r0")
    _settled(gw, 6)
    text = _text(gw)
    assert _sum(text, metrics.GATEWAY_MIRROR_REQUESTS, revision="new") >= 1
    assert all(b["logprobs"] is True for b in canary_engine.bodies)  # mirrors only
    counted = figures.parse(text, "tiny")
    assert counted.get("new", rollout.Counters()).requests == 0


def _answer(tokens: list[str], logprobs: list[float]) -> dict:
    tops = [{t: lp, "zz": lp - 3.0} for t, lp in zip(tokens, logprobs, strict=True)]
    return {"choices": [{"text": " ".join(tokens), "logprobs": {
        "tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops}}],
        "usage": {"completion_tokens": len(tokens)}}  # fmt: skip


def test_a_pair_with_logprobs_records_divergence_per_token():
    """Real engines send logprobs: each compared token's divergence is observed, and the
    answer times too (a mirror with logprobs once died before counting them)."""
    import asyncio

    from kubellm.gateway.discovery.base import ModelTarget
    from kubellm.gateway.routing.canary import mirror
    from kubellm.gateway.routing.replicas.load import LoadView
    from prometheus_client import CollectorRegistry

    answers = {"http://s": _answer(["a", "b", "c"], [-0.1, -0.2, -0.3]),
               "http://c": _answer(["a", "b", "c"], [-0.4, -0.2, -0.5])}  # fmt: skip

    async def post(url, path, body):
        return answers[url], 0.3

    target = ModelTarget("tiny", "tiny", endpoints=(Endpoint("http://s"),
                         Endpoint("http://c", revision="new")),
                         canary=CanarySplit("new", 0, 1.0, 4, 2))  # fmt: skip
    registry = CollectorRegistry()
    metrics_ = mirror.metrics_for(registry)

    async def run() -> None:
        m = mirror.Mirror(metrics_, post, LoadView())
        assert m.offer(target, "http://s", "/v1/completions", {"prompt": "x"}, 1)
        await asyncio.gather(*m.tasks)

    asyncio.run(run())
    text = generate_latest(registry).decode()
    assert _sum(text, metrics.GATEWAY_MIRROR_DIVERGENCE + "_count") == 3
    assert abs(_sum(text, metrics.GATEWAY_MIRROR_DIVERGENCE + "_sum") - 0.5) < 1e-9
    assert _sum(text, metrics.GATEWAY_MIRROR_TPOT + "_count") == 1


# ------------------------------------------------------------ the stable side's reference


def _sse(texts: list[str]) -> list[bytes]:
    import json

    choice = {"index": 0, "finish_reason": None}
    events = [{"id": "c", "object": "text_completion", "created": 0, "model": "tiny",
               "choices": [{**choice, "text": t}]} for t in texts]  # fmt: skip

    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


class _Ticket:
    """What the mirror reads of a request's ticket (lifecycle.Ticket): when it arrived, its
    tap, and its answer's text events."""

    def __init__(self) -> None:
        import time
        from types import SimpleNamespace

        self.arrived = time.monotonic()
        self.tap = None
        self.timing = SimpleNamespace(chunks=0)

    def answer(self, pieces: list[bytes], whole: bool = True) -> None:
        for piece in pieces:
            self.tap.feed(piece)
        self.timing.chunks = len(pieces) - 1
        self.tap.end(whole)


def _mirror_with(answers: dict[str, dict], load=None):
    from kubellm.gateway.routing.canary import mirror
    from kubellm.gateway.routing.replicas.load import LoadView
    from prometheus_client import CollectorRegistry

    asked: list[tuple[str, dict]] = []

    async def post(url, path, body):
        asked.append((url, body))
        return answers[url], 0.2

    registry = CollectorRegistry()
    return mirror.Mirror(mirror.metrics_for(registry), post, load or LoadView()), asked, registry


def _split_target():
    from kubellm.gateway.discovery.base import ModelTarget

    return ModelTarget("tiny", "tiny", endpoints=(Endpoint("http://s"),
                       Endpoint("http://c", revision="new")),
                       canary=CanarySplit("new", 0, 1.0, 4, 4))  # fmt: skip


CANARY_ANSWER = {"choices": [{"text": "The cat sat on", "logprobs": {
    "tokens": ["The", " cat", " sat", " on"], "token_logprobs": [-0.1] * 4,
    "top_logprobs": [{}] * 4}}], "usage": {"completion_tokens": 4}}  # fmt: skip


def test_a_greedy_request_is_compared_with_the_clients_own_answer_stable_is_not_asked():
    """The client asked for greedy decoding: its answer from stable (kept as it passed)
    is the reference; only the canary is asked, and only once that answer ended."""
    import asyncio

    m, asked, registry = _mirror_with({"http://c": CANARY_ANSWER})
    body = {"prompt": "x", "temperature": 0, "stream": True, "max_tokens": 4}

    async def run() -> None:
        ticket = _Ticket()
        assert m.offer(_split_target(), "http://s", "/v1/completions", body, 1, ticket)
        await asyncio.sleep(0)
        assert asked == [] and m.waiting == 1  # nothing asked while the client is served
        ticket.answer(_sse(["The", " cat", " sat", " on"]))
        await asyncio.gather(*m.tasks)

    asyncio.run(run())
    assert [url for url, _ in asked] == ["http://c"]  # stable's work is not done twice
    assert asked[0][1]["temperature"] == 0 and asked[0][1]["max_tokens"] == 4
    text = generate_latest(registry).decode()
    assert _sum(text, metrics.GATEWAY_MIRROR_REQUESTS) == 1
    assert _sum(text, metrics.GATEWAY_MIRROR_AGREED) == 1
    assert _sum(text, metrics.GATEWAY_MIRROR_TOKENS_AGREED) == 4
    assert m.waiting == 0 and m.in_flight == 0


def test_a_seeded_request_asks_the_canary_with_the_clients_own_sampling():
    import asyncio

    m, asked, registry = _mirror_with({"http://c": CANARY_ANSWER})
    body = {"prompt": "x", "temperature": 0.8, "seed": 7, "top_p": 0.9}
    whole = {"choices": [{"text": "The cat ran"}], "usage": {"completion_tokens": 3}}

    async def run() -> None:
        ticket = _Ticket()
        assert m.offer(_split_target(), "http://s", "/v1/completions", body, 1, ticket)
        ticket.answer([__import__("json").dumps(whole).encode()])
        await asyncio.gather(*m.tasks)

    asyncio.run(run())
    assert [url for url, _ in asked] == ["http://c"]
    sent = asked[0][1]
    decoding = (sent["temperature"], sent["seed"], sent["top_p"], sent["stream"])
    assert decoding == (0.8, 7, 0.9, False)
    text = generate_latest(registry).decode()
    assert _sum(text, metrics.GATEWAY_MIRROR_REQUESTS) == 1
    assert _sum(text, metrics.GATEWAY_MIRROR_AGREED) == 0  # " ran" is not " sat"


def test_a_sampled_request_asks_stable_only_when_it_is_idle_and_never_for_a_failed_answer():
    """Not greedy, not seeded: stable's greedy answer is asked for, after the client's
    answer ended and only while the replica is idle; otherwise the mirror is shed."""
    import asyncio

    from kubellm.gateway.routing.replicas.load import LoadView

    load = LoadView()
    answers = {"http://s": CANARY_ANSWER, "http://c": CANARY_ANSWER}
    m, asked, registry = _mirror_with(answers, load)
    body = {"prompt": "x", "stream": True}

    async def run() -> None:
        busy = _Ticket()
        assert m.offer(_split_target(), "http://s", "/v1/completions", body, 1, busy)
        release = load.acquire("http://s")  # another client's request runs there
        busy.answer(_sse(["a"]))
        release()
        failed = _Ticket()
        assert m.offer(_split_target(), "http://s", "/v1/completions", body, 1, failed)
        failed.answer(_sse(["a"])[:1], whole=False)  # the client's answer broke off
        idle = _Ticket()
        assert m.offer(_split_target(), "http://s", "/v1/completions", body, 1, idle)
        idle.answer(_sse(["a"]))
        await asyncio.gather(*m.tasks)

    asyncio.run(run())
    assert sorted(url for url, _ in asked) == ["http://c", "http://s"]  # the idle one only
    assert all(b["temperature"] == 0 and b["seed"] == 0 for _, b in asked)
    text = generate_latest(registry).decode()
    assert _sum(text, metrics.GATEWAY_MIRROR_SHED, reason="stable-busy") == 1
    assert _sum(text, metrics.GATEWAY_MIRROR_SHED, reason="no-reference") == 1
    assert _sum(text, metrics.GATEWAY_MIRROR_REQUESTS) == 1
    assert m.asking == {} and m.waiting == 0


def test_greedy_streams_through_the_gateway_cost_the_stable_replica_nothing_more(engines, gateway):
    (stable_engine, stable), (canary_engine, canary) = engines(2, prefix="r")
    canary_engine.name = "r0"  # the same answers as the stable engine
    gw = gateway({"tiny": _target(stable, canary)})
    client = gw.client()
    prompts = _stable_prompts(5)
    for messages in prompts:
        stream = client.chat.completions.create(
            model="tiny", messages=messages, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text.startswith("r0")
    _settled(gw, 5)
    text = _text(gw)
    compared = _sum(text, metrics.GATEWAY_MIRROR_REQUESTS)
    assert compared >= 1 and _sum(text, metrics.GATEWAY_MIRROR_AGREED) == compared
    assert len(stable_engine.bodies) == len(prompts)  # the clients' requests only
    assert len(canary_engine.bodies) == compared


# ------------------------------------------------- sampled requests get a seed before they go


def _shape(value):
    """An answer's keys, nested, with every leaf's type (not its value)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return type(value).__name__


def test_a_sampled_request_gets_a_seed_and_its_own_answer_is_the_reference(engines, gateway):
    """No temperature 0, no seed: the gateway adds a random seed before forwarding, so the
    client's answer is the reference and the stable engine gets the clients' requests only
    (before, it was asked again for a greedy answer whenever idle)."""
    import httpx

    (stable_engine, stable), (canary_engine, canary) = engines(2, prefix="r")
    canary_engine.name = "r0"  # the same answers as the stable engine
    gw = gateway({"tiny": _target(stable, canary)})
    plain = gateway({"tiny": model("tiny", [stable])})  # the same replica, no shadow
    prompts = _stable_prompts(5)
    shapes = []
    for messages in prompts:
        body = {"model": "tiny", "messages": messages, "temperature": 0.7, "max_tokens": 8}
        answers = [httpx.post(f"{g.url}/v1/chat/completions", json=body, timeout=30)
                   for g in (gw, plain)]  # fmt: skip
        assert [a.status_code for a in answers] == [200, 200]
        shapes.append([_shape(a.json()) for a in answers])
    _settled(gw, 5)
    assert all(mirrored == unmirrored for mirrored, unmirrored in shapes)  # the same shape
    forwarded = stable_engine.bodies[0::2]  # the shadow gateway's (then the plain one's)
    assert len(stable_engine.bodies) == 2 * len(prompts)  # the clients' requests only
    assert all(isinstance(b.get("seed"), int) and b["temperature"] == 0.7 for b in forwarded)
    assert "seed" not in stable_engine.bodies[1]  # no shadow, no seed
    assert len({b["seed"] for b in forwarded}) == len(forwarded)  # drawn per request
    compared = _sum(_text(gw), metrics.GATEWAY_MIRROR_REQUESTS)
    assert compared >= 1 and _sum(_text(gw), metrics.GATEWAY_MIRROR_AGREED) == compared
    asked = {b["messages"][0]["content"]: b for b in canary_engine.bodies}
    for sent in forwarded:  # the canary draws with the client's decoding and seed
        if (mirror := asked.get(sent["messages"][0]["content"])) is not None:
            assert (mirror["seed"], mirror["temperature"]) == (sent["seed"], 0.7)


def test_a_clients_seed_is_never_replaced(engines, gateway):
    (stable_engine, stable), (canary_engine, canary) = engines(2, prefix="r")
    gw = gateway({"tiny": _target(stable, canary)})
    client = gw.client()
    for messages in _stable_prompts(3):
        client.chat.completions.create(model="tiny", messages=messages, temperature=0.9, seed=42)
    _settled(gw, 3)
    assert [b["seed"] for b in stable_engine.bodies] == [42, 42, 42]
    assert canary_engine.bodies and all(b["seed"] == 42 for b in canary_engine.bodies)


def test_seeded_adds_a_seed_only_where_it_makes_the_answer_a_reference():
    from kubellm.gateway.routing.canary import mirror

    m, _, _ = _mirror_with({})
    path = "/v1/completions"
    added = m.seeded({"prompt": "x", "temperature": 0.8}, path)
    assert added is not None and isinstance(added["seed"], int) and added["temperature"] == 0.8
    assert mirror.reusable(added, path)
    for body in ({"prompt": "x", "temperature": 0},  # greedy: its answer is one already
                 {"prompt": "x", "seed": 3}, {"prompt": "x", "seed": None},  # the client's
                 {"prompt": "x", "n": 2}, {"prompt": "x", "use_beam_search": True}):  # fmt: skip
        assert m.seeded(body, path) is None, body
