"""The simulator's prefill and decode roles speak vLLM's kv_transfer_params protocol (P/D,
issue 41): the prefill role names its KV blocks, the decode role takes the prompt's KV
from the connector (external prefix-cache hits) after the link's transfer time."""

from __future__ import annotations

import json

import httpx
from kubellm.engine import sim_profiles
from kubellm.engine.sim import create_app
from kubellm.gateway.protocol.kv_transfer import decode_body, kv_params_of, prefill_body
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kubellm import metrics

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
PROFILE = "llama-3.1-8b-h100"


def client_for(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text

    def key(sample: Sample) -> str:  # a by-source counter's samples apart
        source = sample.labels.get("source")
        return sample.name + (f'{{source="{source}"}}' if source else "")

    return {key(s): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def request(prompt: str, max_tokens: int = 8) -> dict[str, object]:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens}


async def split(prefill: httpx.AsyncClient, decode: httpx.AsyncClient, body: dict) -> dict:
    leg = await prefill.post("/v1/completions", content=prefill_body(body))
    assert leg.status_code == 200, leg.text
    params = kv_params_of(leg.content)
    assert params is not None, leg.text
    answer = await decode.post("/v1/completions", content=decode_body(body, params))
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_a_split_request_computes_no_prompt_on_decode_and_gives_the_same_tokens() -> None:
    prefill_app = create_app("m", PROFILE, 0, role="prefill", kv_address=("10.0.0.7", 8001))
    decode_app = create_app("m", PROFILE, 0, role="decode")
    body = request("the quick brown fox jumps over the lazy dog " * 90)
    async with (
        client_for(prefill_app) as prefill,
        client_for(decode_app) as decode,
        client_for(create_app("m", PROFILE, 0)) as alone,
    ):
        leg = await prefill.post("/v1/completions", content=prefill_body(body))
        params = kv_params_of(leg.content)
        assert params is not None and leg.json()["usage"]["completion_tokens"] == 1
        prompt_tokens = leg.json()["usage"]["prompt_tokens"]
        block = sim_profiles.get(PROFILE).block_size
        assert len(params["remote_block_ids"]) == (prompt_tokens - 1) // block
        assert (params["remote_host"], params["remote_port"]) == ("10.0.0.7", 8001)
        before = await scrape(decode)
        clock = decode_app.state.simulator.clock
        start = clock.now()
        answer = await decode.post("/v1/completions", content=decode_body(body, params))
        assert answer.status_code == 200, answer.text
        after = await scrape(decode)
        # every prompt token came over the connector; decode computed only the last one
        assert after[EXTERNAL_HITS] - before.get(EXTERNAL_HITS, 0) == prompt_tokens
        computed = f'{metrics.PROMPT_TOKENS_BY_SOURCE}{{source="{metrics.COMPUTED_SOURCE}"}}'
        assert after[computed] - before.get(computed, 0) == 1
        # vLLM's prompt counter counts them all, wherever their KV came from
        assert after[metrics.PROMPT_TOKENS] - before.get(metrics.PROMPT_TOKENS, 0) == prompt_tokens
        # the transfer took its time on the simulated clock: KV bytes over the link
        profile = decode_app.state.simulator.profile
        assert clock.now() - start >= profile.kv_transfer_seconds(prompt_tokens) > 0
        same = await alone.post("/v1/completions", json=body)
        assert answer.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]


async def test_only_the_part_not_cached_on_decode_comes_over_the_connector() -> None:
    async with (
        client_for(create_app("m", PROFILE, 0, role="prefill")) as prefill,
        client_for(create_app("m", PROFILE, 0, role="decode")) as decode,
    ):
        shared = "a system prompt every request shares " * 60
        first = await decode.post("/v1/completions", json=request(shared + "question one"))
        assert first.status_code == 200
        before = await scrape(decode)
        answer = await split(prefill, decode, request(shared + "another question " * 20))
        after = await scrape(decode)
        external = after[EXTERNAL_HITS] - before[EXTERNAL_HITS]
        local = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        assert local > 0 and external > 0
        assert local + external == answer["usage"]["prompt_tokens"]


async def test_without_a_role_the_params_are_ignored_and_bad_params_are_a_400() -> None:
    async with client_for(create_app("m", PROFILE, 0)) as alone:
        body = request("hello there " * 50)
        leg = await alone.post("/v1/completions", content=prefill_body(body))
        assert leg.status_code == 200 and "kv_transfer_params" not in leg.json()
        metrics = await scrape(alone)
        assert EXTERNAL_HITS not in metrics
        params = {"do_remote_prefill": True, "remote_block_ids": [1]}
        answer = await alone.post("/v1/completions", content=decode_body(body, params))
        assert answer.status_code == 200
        assert (await scrape(alone))["vllm:prompt_tokens_total"] > 2
    async with client_for(create_app("m", PROFILE, 0, role="decode")) as decode:
        bad = await decode.post("/v1/completions", content=json.dumps(
            {**request("hi"), "kv_transfer_params": "yes"}
        ))  # fmt: skip
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "kv_transfer_params"


def test_a_role_needs_a_spec_with_spec_prefill(tmp_path, capsys) -> None:
    from kubellm import cli

    assert cli.main(["engine", "--backend", "sim", "--role", "decode"]) == 2
    assert "--role decode: give the --spec" in capsys.readouterr().err
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": {"source": "hf://org/m"}}))
    assert cli.main(["engine", "--backend", "sim", "--role", "prefill", "--spec", str(spec)]) == 2
    assert "spec.prefill" in capsys.readouterr().err
