"""LoRA in the simulator: slots with LRU swapping and a load time, vLLM's lora info metric,
/v1/models with adapters, and vLLM's runtime adapter API."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from kubellm.engine import cli, sim_profiles
from kubellm.engine.sim import create_app
from kubellm.engine.sim_core import Engine, Request
from prometheus_client.parser import text_string_to_metric_families

from kubellm import contracts, metrics
from tests.fixtures.polling import eventually

LORA = sim_profiles.Profile(
    name="lora", block_size=16, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=512,
    max_model_len=512, step_base_s=0.01, prefill_token_s=0.0, decode_token_s=0.0,
    max_loras=2, lora_load_s=0.5,
)  # fmt: skip


def _request(ident: str, lora: str | None, tokens: int = 4) -> Request:
    return Request(ident, list(range(1, 17)), tokens, lora=lora)


def test_a_batch_holds_at_most_max_loras_adapters_and_later_requests_may_pass() -> None:
    engine = Engine(LORA)
    for ident, lora in [("a1", "a"), ("b1", "b"), ("c1", "c"), ("base", None), ("a2", "a")]:
        engine.add(_request(ident, lora))
    engine.step()
    running = [r.request_id for r in engine.running]
    # c1 would be a third adapter: skipped, keeps its place; the base model and a2 pass it
    assert running == ["a1", "b1", "base", "a2"]
    assert [r.request_id for r in engine.waiting] == ["c1"]
    assert engine.lora_adapters() == (["a", "b"], ["c"])


def test_loading_an_adapter_into_a_slot_costs_the_load_time_and_evicts_the_lru_idle_one() -> None:
    engine = Engine(LORA)
    engine.add(_request("a1", "a", tokens=1))
    first = engine.step()
    assert first.duration == pytest.approx(LORA.step_base_s + LORA.lora_load_s)
    assert engine.lora_loads == 1
    engine.add(_request("a2", "a", tokens=1))
    assert engine.step().duration == pytest.approx(LORA.step_base_s)  # still in its slot
    for ident, lora in [("b1", "b"), ("c1", "c")]:
        engine.add(_request(ident, lora, tokens=1))
        engine.step()
    assert engine.lora_loads == 3
    assert list(engine.lora_slots) == ["b", "c"]  # a was the least recently used
    engine.add(_request("a3", "a", tokens=1))
    engine.step()
    assert engine.lora_loads == 4 and list(engine.lora_slots) == ["c", "a"]


def test_without_lora_nothing_changes() -> None:
    profile = sim_profiles.get("tiny-cpu")
    assert profile.max_loras == 0
    engine = Engine(profile)
    engine.add(Request("x", list(range(1, 40)), 1))
    assert engine.step().duration == pytest.approx(profile.step_seconds(39, 0))
    assert engine.lora_loads == 0


def client_for(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")


def lora_info(text: str) -> list[dict[str, str | float]]:
    return [
        {**s.labels, "value": s.value}
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == metrics.LORA_REQUESTS_INFO
    ]


async def test_models_requests_and_the_runtime_adapter_api_answer_as_vllm() -> None:
    app = create_app("base", LORA, time_scale=0.01, adapters={"sql": "/adapters/sql"})
    async with client_for(app) as client:
        cards = (await client.get("/v1/models")).json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("base", None), ("sql", "base")]
        assert cards[1]["root"] == "/adapters/sql"

        answer = await client.post("/v1/completions", json={"model": "sql", "prompt": "hi",
                                                             "max_tokens": 3})  # fmt: skip
        assert answer.status_code == 200 and answer.json()["model"] == "sql"
        missing = await client.post("/v1/completions", json={"model": "legal", "prompt": "hi"})
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "The model `legal` does not exist."

        load = {"lora_name": "legal", "lora_path": "/adapters/legal"}
        untyped = await client.post("/v1/load_lora_adapter", content=json.dumps(load))
        assert untyped.status_code == 400 and "Unsupported Media Type" in untyped.text
        loaded = await client.post("/v1/load_lora_adapter", json=load)
        assert loaded.status_code == 200
        assert loaded.text == "Success: LoRA adapter 'legal' added successfully."
        again = await client.post("/v1/load_lora_adapter", json=load)
        assert again.status_code == 400 and "has already been loaded" in again.text
        clash = await client.post("/v1/load_lora_adapter",
                                  json={"lora_name": "base", "lora_path": "/x"})  # fmt: skip
        assert clash.status_code == 400 and "conflicts with a served base model" in clash.text
        ids = [c["id"] for c in (await client.get("/v1/models")).json()["data"]]
        assert ids == ["base", "sql", "legal"]
        ok = await client.post("/v1/completions", json={"model": "legal", "prompt": "hi",
                                                         "max_tokens": 2})  # fmt: skip
        assert ok.status_code == 200

        removed = await client.post("/v1/unload_lora_adapter", json={"lora_name": "legal"})
        assert removed.status_code == 200
        assert removed.text == "Success: LoRA adapter 'legal' removed successfully."
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "legal"})
        assert gone.status_code == 404
        assert gone.json()["error"]["message"] == "The lora adapter 'legal' cannot be found."


async def test_without_lora_the_adapter_api_is_absent_like_vllms() -> None:
    async with client_for(create_app("base", "tiny-cpu", 0)) as client:
        response = await client.post("/v1/load_lora_adapter", json={"lora_name": "a"})
        assert response.status_code in (404, 405)
        assert lora_info((await client.get("/metrics")).text) == []


async def test_lora_requests_info_is_exported_as_vllm_exports_it() -> None:
    """Labels max_lora, waiting_lora_adapters, running_lora_adapters (comma-joined), the value
    the time of the last update; a label set that is no longer current stays exported."""
    app = create_app("base", LORA, time_scale=0.05, adapters={"a": "/a", "b": "/b", "c": "/c"})
    async with client_for(app) as client:
        idle = lora_info((await client.get("/metrics")).text)
        assert [(s["max_lora"], s["running_lora_adapters"], s["waiting_lora_adapters"])
                for s in idle] == [("2", "", "")]  # fmt: skip
        body = {"prompt": "hello there", "max_tokens": 40}
        tasks = [
            asyncio.create_task(client.post("/v1/completions", json={**body, "model": m}))
            for m in ("a", "b", "c")
        ]

        async def queued_behind_two() -> list | None:
            busy = [s for s in lora_info((await client.get("/metrics")).text)
                    if s["running_lora_adapters"]]  # fmt: skip
            latest = max(busy, key=lambda s: s["value"]) if busy else None
            return busy if latest and latest["waiting_lora_adapters"] == "c" else None

        busy = await eventually(queued_behind_two, what="c waiting behind a and b")
        current = max(busy, key=lambda s: s["value"])
        assert current["running_lora_adapters"] == "a,b"
        assert current["waiting_lora_adapters"] == "c"
        assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))
        after = lora_info((await client.get("/metrics")).text)
        assert len(after) >= 2  # the idle series, the busy ones: all still exported
        latest = max(after, key=lambda s: s["value"])
        assert (latest["running_lora_adapters"], latest["waiting_lora_adapters"]) == ("", "")


def test_a_spec_with_adapters_runs_the_simulator_with_them(tmp_path: Path) -> None:
    spec = {
        "model": {"source": "hf://org/base", "servedName": "base"},
        "adapters": [{"name": "sql", "source": "hf://org/sql"}],
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    profile, served = cli.sim_profile(None, str(path))
    assert (profile.max_loras, served) == (contracts.DEFAULT_MAX_LORAS, "base")
    assert cli.sim_adapters(str(path)) == {"sql": "org/sql"}  # the id vLLM loads, as pods do
    spec["engine"] = {"maxLoras": 3}
    path.write_text(json.dumps(spec))
    assert cli.sim_profile(None, str(path))[0].max_loras == 3


def test_the_simulator_refuses_adapters_without_lora() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        create_app("base", "tiny-cpu", 0, adapters={"a": "/a"})
