"""The canary split (routing/canary/revisions.py) and how discovery carries it: table tests of the
pure choice, the EndpointSlices of a canary Service, and the router's hook."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

import pytest
from kubellm.gateway.discovery import kubernetes as k8s
from kubellm.gateway.discovery.base import CanarySplit, Endpoint, ModelTarget, canary_split
from kubellm.gateway.routing.canary import revisions
from kubellm.gateway.routing.replicas.load import LoadView
from kubellm.gateway.routing.replicas.outliers import OutlierDetector
from kubellm.gateway.routing.router import Router, routing_request
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.operator import figures, rollout
from prometheus_client import generate_latest

from kubellm import api
from tests.fixtures.engines import wait_until
from tests.gateway.conftest import model

KEYS = [f"prefix:{i}" for i in range(4000)]


@pytest.mark.parametrize("weight", [0, 1, 10, 25, 50, 90, 100])
def test_the_canary_takes_its_weight_of_keys(weight):
    share = sum(revisions.to_canary(k, weight) for k in KEYS) / len(KEYS)
    assert abs(share - weight / 100) < 0.025  # 4,000 keys: a few standard deviations


def test_a_growing_weight_keeps_the_canary_keys_on_the_canary():
    at = {w: {k for k in KEYS if revisions.to_canary(k, w)} for w in (10, 50, 90)}
    assert at[10] <= at[50] <= at[90]


def test_the_choice_is_the_same_everywhere():
    # a fixed hash (SHA-256), not Python's per-process hash(): every gateway agrees
    assert revisions.bucket("session:alice") == revisions.bucket("session:alice")
    # the documented formula (a change would move every session to the other revision)
    digest = hashlib.sha256(b"prefix:1").digest()
    assert revisions.bucket("prefix:1") == int.from_bytes(digest[:8], "big") % 10_000


@pytest.mark.parametrize(
    ("request_", "key"),
    [
        (RoutingRequest("m", session="s1", affinity_key=7), "session:s1"),
        (RoutingRequest("m", affinity_key=7), "prefix:7"),
        (RoutingRequest("m"), ""),
    ],
)
def test_request_key_is_the_session_else_the_prompt_home(request_, key):
    assert revisions.request_key(request_) == key


ITEMS = ["s1", "s2", "c1"]
REVS = {0: None, 1: "old", 2: "new"}  # "old" is not the canary: stable side


@pytest.mark.parametrize(
    ("split", "items", "canary_key", "expected"),
    [
        (None, ITEMS, True, ITEMS),  # no rollout: everyone
        (CanarySplit("new", 0), ITEMS, True, ["s1", "s2"]),  # rolled back
        (CanarySplit("new", 100), ITEMS, False, ["c1"]),
        (CanarySplit("new", 50), ITEMS, True, ["c1"]),
        (CanarySplit("new", 50), ITEMS, False, ["s1", "s2"]),
        (CanarySplit("new", 50), ["s1", "s2"], True, ["s1", "s2"]),  # canary not ready yet
        (CanarySplit("new", 0), ["c1"], False, ["c1"]),  # no stable left: the canary serves
        (CanarySplit("new", 0, 0.1, 4), ["c1"], False, []),  # the shadow step: never a client's
    ],
)
def test_choose(split, items, canary_key, expected):
    # a key that falls in the canary's half, and one that does not
    key = next(k for k in KEYS if revisions.to_canary(k, 50) == canary_key)
    revs = {i: REVS[ITEMS.index(item)] for i, item in enumerate(items)}
    assert revisions.choose(items, revs, split, key) == expected


@pytest.mark.parametrize(
    ("rollout", "split"),
    [
        (None, None),
        ({"phase": "Stable", "revision": "a", "canaryWeight": 0}, None),
        ({"phase": "Progressing", "canaryRevision": "b", "canaryWeight": 10}, CanarySplit("b", 10)),
        ({"phase": "RolledBack", "canaryRevision": "b", "canaryWeight": 0}, CanarySplit("b", 0)),
        ({"phase": "Promoting", "canaryRevision": "b", "canaryWeight": 100}, None),
        ({"phase": "Progressing", "canaryRevision": "b", "canaryWeight": "x"}, None),
        ({"phase": "Progressing", "canaryRevision": "b", "canaryWeight": 900},
         CanarySplit("b", 100)),
    ],
)  # fmt: skip
def test_canary_split_from_status(rollout, split):
    assert canary_split(rollout) == split


def _slice(name: str, addresses: list[str], revision: str | None = None):
    labels = {"kubellm.io/deployment": "m"}
    if revision:
        labels["kubellm.io/revision"] = revision
    return {
        "metadata": {"name": name, "namespace": "ml", "labels": labels},
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses],
    }


def test_discovery_labels_canary_endpoints_and_carries_the_weight():
    item = {
        "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": "m", "namespace": "ml"},
        "spec": {"model": {"source": "hf://org/m"}},
        "status": {"rollout": {"phase": "Progressing", "canaryRevision": "c0ffee",
                               "canaryWeight": 10}},
    }  # fmt: skip
    deployments = k8s.parse_deployments([item])
    # the engine Service selects every engine pod, the canary Service its own: a canary pod
    # is in both slices, whichever comes first
    slices = [
        _slice("m-engine-a", ["10.0.0.3"], "c0ffee"),
        _slice("m-engine-b", ["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
    ]
    target = k8s.build_targets(deployments, slices, {}, k8s.canary_splits([item]))["m"]
    assert target.canary == CanarySplit("c0ffee", 10)
    assert [(e.url, e.revision) for e in target.endpoints] == [
        ("http://10.0.0.1:8000", None),
        ("http://10.0.0.2:8000", None),
        ("http://10.0.0.3:8000", "c0ffee"),
    ]


def test_the_router_orders_only_the_chosen_revision():
    urls = ["http://s1", "http://s2", "http://c1"]
    target = ModelTarget(
        "m", "m",
        endpoints=(Endpoint(urls[0]), Endpoint(urls[1]), Endpoint(urls[2], revision="new")),
        canary=CanarySplit("new", 50),
    )  # fmt: skip
    router = Router(LoadView(), OutlierDetector(), random.Random(1))
    candidates = [Candidate(url=u, load=0.0) for u in urls]
    seen: dict[bool, set[str]] = {True: set(), False: set()}
    for i in range(200):
        request = routing_request("m", {"prompt": f"system prompt {i} " * 40}, session=None)
        order = router.order(target, request, candidates)
        seen[revisions.to_canary(revisions.request_key(request), 50)].update(c.url for c in order)
    assert seen[True] == {"http://c1"}
    assert seen[False] == {"http://s1", "http://s2"}


def counted_by(gw) -> dict[str, rollout.Counters]:
    """The gateway's per-revision counters, read as the operator reads them."""
    return figures.parse(generate_latest(gw.gateway.metrics.registry).decode(), "tiny")


def test_a_split_gateway_counts_each_revision_for_the_canary_analysis(engines, gateway):
    """Real servers: a gateway splitting a model 50/50 sends each prompt home to one
    revision, and its per-revision series (read as the operator reads them) count it."""
    (_, stable), (_, canary) = engines(2, prefix="r")
    target = model("tiny", [stable, canary])
    target = replace(
        target,
        endpoints=(Endpoint(stable.url), Endpoint(canary.url, revision="new")),
        canary=CanarySplit("new", 50),
    )
    gw = gateway({"tiny": target})
    client = gw.client()
    expected = {"new": 0, "stable": 0}
    for i in range(16):
        prompt = f"System prompt {i} of the split test. " * 30
        messages = [{"role": "user", "content": prompt}]
        request = routing_request("tiny", {"messages": messages}, session=None)
        side = "new" if revisions.to_canary(revisions.request_key(request), 50) else "stable"
        expected[side] += 1
        stream = client.chat.completions.create(model="tiny", messages=messages, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text.startswith("r1" if side == "new" else "r0")  # the engine's name
    assert expected["new"] and expected["stable"]  # both sides taken by these prompts
    # the gateway counts an answer once its stream is closed, just after the client's end
    wait_until(lambda: sum(c.requests for c in counted_by(gw).values()) == 16, what="counts")
    counted = counted_by(gw)
    assert {r: int(c.requests) for r, c in counted.items()} == expected
    assert counted["new"].ttft_count == expected["new"] and counted["new"].errors == 0


def test_a_canary_answering_5xx_is_counted_even_when_a_retry_saves_the_request(engines, gateway):
    """The gateway retries a 5xx before the first byte on another replica: the client never
    sees the canary's failure, but the canary's error series does, and the analysis fails it."""
    (_, stable), (bad, canary) = engines(2, prefix="r")
    bad.behaviour.status = 500
    target = replace(
        model("tiny", [stable, canary]),
        endpoints=(Endpoint(stable.url), Endpoint(canary.url, revision="new")),
        canary=CanarySplit("new", 50),
    )
    gw = gateway({"tiny": target})
    client = gw.client()
    for i in range(16):
        messages = [{"role": "user", "content": f"System prompt {i} of the 5xx test. " * 30}]
        stream = client.chat.completions.create(model="tiny", messages=messages, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    wait_until(lambda: (c := counted_by(gw)).get("stable") and c["stable"].requests == 16,
               what="every answer counted")  # fmt: skip
    counted = counted_by(gw)
    assert counted["new"].errors >= 1 and counted["new"].errors == counted["new"].requests
    assert counted["stable"].errors == 0 and counted["stable"].requests == 16
    verdict = rollout.analyse(counted["new"], counted["stable"],
                              api.RolloutAnalysis(minRequests=1), api.SLO())  # fmt: skip
    assert verdict.reason == "CanaryErrorRate"


async def test_a_retry_tries_its_own_revision_before_the_other():
    """Through the scheduler and its ticket (what the front ends retry down): the replicas
    to try are the assigned revision's, open ones best first, then its saturated ones; the
    other revision's come only after every one of its own (a canary answering 5xx on its
    only replica is retried on the stable one: the test above)."""
    from kubellm.gateway.discovery.base import FixedDiscovery
    from kubellm.gateway.routing.admission import Thresholds
    from kubellm.gateway.routing.scheduler import Scheduler, SchedulerSettings

    stable = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    canary = ["http://10.0.0.3:8000", "http://10.0.0.4:8000"]
    target = ModelTarget(
        "m", "m",
        endpoints=(*(Endpoint(u) for u in stable), *(Endpoint(u, revision="new") for u in canary)),
        canary=CanarySplit("new", 50),
    )  # fmt: skip
    settings = SchedulerSettings(thresholds=Thresholds(max_in_flight=1))
    scheduler = Scheduler(FixedDiscovery({"m": target}), settings)
    for url in (stable[0], canary[0]):  # one replica of each side saturated
        scheduler.load.acquire(url)
    seen = {True: 0, False: 0}
    for i in range(24):
        request = routing_request("m", {"prompt": f"system prompt {i} " * 40}, session=None)
        side = revisions.to_canary(revisions.request_key(request), 50)
        own, other = (canary, stable) if side else (stable, canary)
        ticket = await scheduler.admit(target, request)
        assert ticket.route == "replica"
        assert ticket.urls() == [own[1], own[0], *other] or ticket.urls() == [
            own[1], own[0], *reversed(other)
        ], (i, side, ticket.urls())  # fmt: skip
        ticket.finish()
        seen[side] += 1
    assert seen[True] and seen[False]  # both sides taken by these prompts


def _shadow_scheduler(stable_busy: int, stable_down: bool = False):
    """Two stable replicas and one canary in the shadow step (weight 0, a mirror share),
    at most one request each; `stable_busy` of the stable ones hold a request."""
    from kubellm.gateway.discovery.base import FixedDiscovery
    from kubellm.gateway.routing.admission import Thresholds
    from kubellm.gateway.routing.scheduler import Scheduler, SchedulerSettings

    stable = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    canary = "http://10.0.0.3:8000"
    target = ModelTarget(
        "m", "m",
        endpoints=(*(Endpoint(u) for u in stable), Endpoint(canary, revision="new")),
        canary=CanarySplit("new", 0, shadow_share=0.1, shadow_concurrency=2),
        slo=api.SLO(ttftSeconds=0.05),  # the wait budget: a refusal comes at once
    )  # fmt: skip
    settings = SchedulerSettings(thresholds=Thresholds(max_in_flight=1))
    scheduler = Scheduler(FixedDiscovery({"m": target}), settings)
    for url in stable[:stable_busy]:
        scheduler.load.acquire(url)
    if stable_down:
        for url in stable:
            for _ in range(settings.eject_after_failures):
                scheduler.failed(url, fatal=True)
    return scheduler, target, stable


async def test_in_the_shadow_step_a_request_never_reaches_the_canary():
    """The shadow step's canary answers mirrored requests only: not as a request's
    replica, nor as a retry after every stable replica failed (its answers must not
    reach a client before its verdict)."""
    scheduler, target, stable = _shadow_scheduler(stable_busy=1)
    for i in range(8):
        request = routing_request("m", {"prompt": f"prompt {i} " * 40}, session=None)
        ticket = await scheduler.admit(target, request)
        assert ticket.route == "replica"
        assert ticket.urls() == [stable[1], stable[0]], ticket.urls()  # not the canary's
        ticket.finish()


async def test_in_the_shadow_step_a_saturated_stable_side_queues_not_502():
    """Every stable replica saturated, the canary idle: the request waits for a stable
    slot and is refused 429 when its wait budget ends (the saturated answer), not handed
    an empty list of replicas (a 502 'No replica answered (0 tried)', seen under load)."""
    scheduler, target, _ = _shadow_scheduler(stable_busy=2)
    request = routing_request("m", {"prompt": "hello " * 40}, session=None)
    ticket = await scheduler.admit(target, request)
    assert ticket.refusal is not None and ticket.refusal.status == 429, ticket.urls()
    assert ticket.reason == "saturated"


async def test_in_the_shadow_step_no_stable_replica_is_no_ready_replica():
    """Every stable replica ejected, the canary up: no replica for real traffic (503, or
    the fallback where there is one), not the canary and not a 502."""
    scheduler, target, _ = _shadow_scheduler(stable_busy=0, stable_down=True)
    request = routing_request("m", {"prompt": "hello " * 40}, session=None)
    ticket = await scheduler.admit(target, request)
    assert ticket.refusal is not None, (ticket.route, ticket.urls())
    assert ticket.refusal.status == 503
