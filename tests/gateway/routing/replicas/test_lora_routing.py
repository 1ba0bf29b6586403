"""LoRA adapters through the gateway: where requests naming an adapter go, loading an
adapter no replica has, unloading one the spec dropped, /v1/models, per-adapter metrics.

The pure parts (vLLM's lora info metric, /v1/models cards, the affinity scorer, the load
target) are tested as functions; the rest against simulated engines (real servers on
127.0.0.1 speaking vLLM's LoRA API) behind a real gateway.
"""

from __future__ import annotations

import dataclasses
import time

import httpx
from kubellm.engine import sim_profiles
from kubellm.gateway.discovery.base import AdapterRef, find_model
from kubellm.gateway.routing.replicas import adapters
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest

from kubellm import metrics
from kubellm.api import SLO
from kubellm.contracts import registered_adapters
from kubellm.metrics import LoraInfo, parse_lora_info
from tests.fixtures.engines import wait_until
from tests.gateway.conftest import model

LORA = dataclasses.replace(
    sim_profiles.get("tiny-cpu"), name="tiny-lora", max_loras=2, lora_load_s=0.0
)

INFO = """# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.8e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="d",waiting_lora_adapters=""} 1.6e9
"""


def test_lora_info_is_read_from_the_latest_series() -> None:
    assert parse_lora_info(INFO) == LoraInfo(2, frozenset(), frozenset())
    busy = INFO.replace("1.8e9", "1.5e9")
    assert parse_lora_info(busy) == LoraInfo(2, frozenset("ab"), frozenset("c"))
    assert parse_lora_info("vllm:num_requests_running 3\n") is None


def test_registered_adapters_are_the_cards_with_the_base_as_parent() -> None:
    answer = {"data": [{"id": "base", "parent": None}, {"id": "a", "parent": "base"},
                       {"id": "x", "parent": "other"}]}  # fmt: skip
    assert registered_adapters(answer, "base") == {"a"}
    assert registered_adapters({"oops": 1}, "base") is None


def test_the_scorer_prefers_the_planned_resident_replica_then_any_resident_then_the_plan() -> None:
    view = adapters.AdapterView()
    busy = {"active": "a", "recent": "b,c", "free": "b", "full": "b,c", "home": "a",
            "home-cold": "b"}  # fmt: skip
    for url, running in busy.items():
        now = f'running_lora_adapters="{running}",waiting_lora_adapters=""}} 2e9'
        text = INFO.replace('running_lora_adapters="",waiting_lora_adapters=""} 1.8e9', now)
        view.record_info(url, parse_lora_info(text))
    view.sent("recent", "a", 2)
    plan = adapters.Placement({"a": ("home", "home-cold")}, swap=())
    candidates = [Candidate(u) for u in ("full", "free", "recent", "active", "home", "home-cold")]
    request = RoutingRequest("m", adapter="a")
    scorer = adapters.AdapterScorer(view, 2, plan)
    assert scorer.score(request, candidates) == [0.0, 0.45, 0.75, 0.75, 1.0, 0.5]
    # without a plan: resident 0.75, a free slot 0.45, every slot busy 0
    plain = adapters.AdapterScorer(view, 2)
    assert plain.score(request, candidates) == [0.0, 0.45, 0.75, 0.75, 0.75, 0.45]
    assert plain.score(RoutingRequest("m"), candidates) == [0.0] * 6


def test_the_victim_of_a_load_is_the_least_asked_for_idle_adapter() -> None:
    view = adapters.AdapterView()
    for _ in range(10):
        view.sent("hot", "popular", 1)
    view.sent("cold", "rare", 1)
    view.sent("hot", "popular", 1)
    scores = adapters.AdapterScorer(view, 1).score(
        RoutingRequest("m", adapter="new"), [Candidate("hot"), Candidate("cold")]
    )
    assert scores[0] == 0.0 < scores[1]  # evict the one-off, never the most popular adapter


ZIPF = [1 / rank for rank in range(1, 13)]


def test_the_plan_splits_the_hottest_adapter_and_keeps_a_swap_slot_within_the_bound() -> None:
    demand = {f"a{i:02d}": d for i, d in enumerate(ZIPF)}
    urls = ["r1", "r2", "r3", "r4"]
    plan = adapters.plan_placement(demand, urls, 2, 1.25)
    assert len(plan.homes["a00"]) == 2  # 32% of the requests: more than one replica's share
    assert [len(plan.homes[f"a{i:02d}"]) for i in range(1, 6)] == [1] * 5
    assert not any(f"a{i:02d}" in plan.homes for i in range(6, 12))
    assert len(plan.swap) == 1 and plan.home("a09") == plan.swap
    share = dict.fromkeys(urls, 0.0)
    for name, homes in plan.homes.items():
        for url in homes:
            share[url] += demand[name] / len(homes)
    share[plan.swap[0]] += sum(ZIPF[6:])
    assert max(share.values()) <= 1.25 * sum(ZIPF) / 4  # within the load bound
    slots = {u: sum(u in h for h in plan.homes.values()) + (u in plan.swap) for u in urls}
    assert slots == dict.fromkeys(urls, 2)
    # no bound to keep: the 7 hottest each in a slot, one swap slot for the other 5
    loose = adapters.plan_placement(demand, urls, 2, 4.0)
    assert sorted(loose.homes) == [f"a{i:02d}" for i in range(7)] and len(loose.swap) == 1
    # the same plan whatever the order replicas are listed in (every gateway agrees)
    assert adapters.plan_placement(demand, list(reversed(urls)), 2, 1.25) == plan


def test_the_plan_with_slots_to_spare_gives_the_hottest_more_replicas() -> None:
    plan = adapters.plan_placement({"a": 3.0, "b": 1.0}, ["r1", "r2"], 2, 1.25)
    assert plan.homes == {"a": ("r1", "r2"), "b": ("r1", "r2")} and plan.swap == ()
    assert adapters.plan_placement({}, ["r1"], 2, 1.25) == adapters.Placement({}, ())
    assert adapters.plan_placement({"a": 1.0}, [], 2, 1.25) == adapters.Placement({}, ())


def test_a_replica_where_the_adapter_is_resident_is_not_held_to_the_load_bound() -> None:
    view = adapters.AdapterView()
    view.sent("busy-with-a", "a", 2)
    view.sent("busy-without", "b", 2)
    keep = adapters.AdapterScorer(view, 2).bound_filter("a")
    candidates = [Candidate("busy-with-a", load=9), Candidate("busy-without", load=9),
                  Candidate("idle", load=0), Candidate("idle2", load=0)]  # fmt: skip
    assert [c.url for c in keep(candidates, 1.25)] == ["busy-with-a", "idle", "idle2"]


def test_an_adapter_is_loaded_on_the_least_loaded_candidate() -> None:
    loads = [Candidate("u1", load=3), Candidate("u2", load=1), Candidate("u3", load=2)]
    assert adapters.load_target("a", loads).url == "u2"
    assert adapters.load_target("a", []) is None
    even = [Candidate(f"u{i}") for i in range(4)]
    assert adapters.load_target("a", even) == adapters.load_target("a", list(reversed(even)))


def test_a_request_names_a_model_or_one_of_its_adapters() -> None:
    target = dataclasses.replace(model("base", ["http://e"]), adapters=(AdapterRef("a", "/a"),))
    snapshot = {"base": target}
    assert find_model(snapshot, "base") == (target, None)
    assert find_model(snapshot, "a") == (target, "a")
    assert find_model(snapshot, "b") is None


def _lora_model(urls: list[str], names: dict[str, str]) -> object:
    refs = tuple(AdapterRef(n, p) for n, p in names.items())
    return dataclasses.replace(model("base", urls, policy="least-load"), adapters=refs)


def _chat(url: str, name: str) -> httpx.Response:
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=20)


def _registered(url: str) -> set[str]:
    cards = httpx.get(f"{url}/v1/models", timeout=5).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def test_requests_go_to_the_replica_with_the_adapter_and_others_are_loaded(
    sim_server, gateway
) -> None:
    plain = sim_server("base", LORA)
    with_sql = sim_server("base", LORA, adapters={"sql": "/adapters/sql"})
    names = {"sql": "/adapters/sql", "legal": "/adapters/legal"}
    handle = gateway({"base": _lora_model([plain, with_sql], names)})
    wait_until(lambda: handle.gateway.scheduler.adapters.has(with_sql, "sql"), 10, "a scrape")

    listed = httpx.get(f"{handle.url}/v1/models", timeout=5).json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [
        ("base", None), ("sql", "base"), ("legal", "base"),
    ]  # fmt: skip

    for _ in range(4):  # only with_sql has it: every request goes there, none is loaded
        answer = _chat(handle.url, "sql")
        assert answer.status_code == 200 and answer.json()["model"] == "sql"
    assert _registered(plain) == set()
    labels = {"model": "base", "deployment": "base", "namespace": "default"}
    requests = metrics.GATEWAY_ADAPTER_REQUESTS
    assert handle.metric(requests, **labels, adapter="sql", route="resident") == 4

    answer = _chat(handle.url, "legal")  # on no replica: loaded first, then served
    assert answer.status_code == 200 and answer.json()["model"] == "legal"
    assert "legal" in _registered(plain) | _registered(with_sql)
    assert handle.metric(requests, **labels, adapter="legal", route="loaded") == 1
    loads = metrics.GATEWAY_ADAPTER_LOADS
    assert handle.metric(loads, **labels, adapter="legal", outcome="ok") == 1

    unknown = _chat(handle.url, "nope")
    assert unknown.status_code == 404


def test_an_adapter_dropped_from_the_spec_is_unloaded(sim_server, gateway) -> None:
    url = sim_server("base", LORA, adapters={"a": "/a", "b": "/b"})
    handle = gateway({"base": _lora_model([url], {"a": "/a", "b": "/b"})})
    wait_until(lambda: handle.gateway.scheduler.adapters.has(url, "b"), 10, "a scrape")
    handle.update({"base": _lora_model([url], {"a": "/a"})})
    wait_until(lambda: _registered(url) == {"a"}, 10, "b unloaded")
    assert _chat(handle.url, "b").status_code == 404


def test_blind_routing_sends_adapter_requests_by_load_alone(sim_server, gateway) -> None:
    urls = [sim_server("base", LORA, adapters={"a": "/a"}) for _ in range(2)]
    handle = gateway({"base": _lora_model(urls, {"a": "/a"})}, adapter_affinity=False)
    assert handle.gateway.scheduler.router.adapter_scorer is None
    wait_until(lambda: all(handle.gateway.scheduler.adapters.has(u, "a") for u in urls), 10,
               "a scrape")  # fmt: skip
    assert _chat(handle.url, "a").status_code == 200


def test_a_failed_load_is_not_retried_in_a_loop_and_the_request_is_refused_at_once(
    sim_server, gateway
) -> None:
    url = sim_server("base", "tiny-cpu")  # LoRA off: vLLM's adapter API is absent (404)
    slo = SLO(ttft_seconds=30)
    target = dataclasses.replace(
        model("base", [url], policy="least-load", slo=slo), adapters=(AdapterRef("x", "/x"),)
    )
    handle = gateway({"base": target})
    started = time.monotonic()
    answer = _chat(handle.url, "x")
    assert answer.status_code == 503
    assert time.monotonic() - started < 10  # not the whole 30 s TTFT budget
    labels = {"model": "base", "deployment": "base", "namespace": "default", "adapter": "x"}
    assert handle.metric(metrics.GATEWAY_ADAPTER_LOADS, **labels, outcome="error") == 1
    assert _chat(handle.url, "x").status_code == 503  # within the retry pause: no new load
    assert handle.metric(metrics.GATEWAY_ADAPTER_LOADS, **labels, outcome="error") == 1
    assert handle.metric(metrics.GATEWAY_ADAPTER_REQUESTS, **labels, route="refused") == 2


def test_discovery_turns_spec_adapters_into_the_paths_pods_load() -> None:
    from kubellm.gateway.discovery import static
    from kubellm.gateway.discovery.kubernetes import adapter_refs

    from kubellm.api import LLMDeploymentSpec

    spec = LLMDeploymentSpec.model_validate({
        "model": {"source": "pvc://models/llama"},
        "adapters": [
            {"name": "a", "source": "pvc://models/adapters/a"},
            {"name": "b", "source": "hf://org/b-lora"},
            {"name": "c", "source": "s3://bucket/c"},  # the engine cannot load it: left out
        ],
    })  # fmt: skip
    refs = (AdapterRef("a", "/models/adapters/a"), AdapterRef("b", "org/b-lora"))
    assert adapter_refs(spec) == refs
    parsed = static.parse({"models": [{"name": "m", "endpoints": ["http://e:1"],
                                       "adapters": {"sql": "/adapters/sql"}}]})  # fmt: skip
    assert parsed["m"].adapters == (AdapterRef("sql", "/adapters/sql"),)


def test_a_front_end_that_cannot_load_refuses_at_once(sim_server, gateway) -> None:
    """A scheduler that cannot load (no loader: not started with a client) refuses an
    adapter no replica has (or sends it to the fallback) without waiting out the TTFT
    budget."""
    url = sim_server("base", LORA)
    slo = SLO(ttft_seconds=30)
    target = dataclasses.replace(
        model("base", [url], policy="least-load", slo=slo), adapters=(AdapterRef("x", "/x"),)
    )
    handle = gateway({"base": target})
    handle.server.call(lambda: setattr(handle.gateway.scheduler.adapter_loads, "loader", None))
    started = time.monotonic()
    assert _chat(handle.url, "x").status_code == 503
    assert time.monotonic() - started < 10
    assert _registered(url) == set()
