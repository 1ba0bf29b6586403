"""A real prefill/decode pair: two vLLM CPU engines started through `kubellm engine --role`,
the KV cache moved by NIXL (UCX over shared memory and TCP on loopback).

The prefill leg (max_tokens 1, kv_transfer_params do_remote_decode) runs on the prefill
engine; the decode leg, carrying the kv_transfer_params it returned, runs on the decode
engine, which must give the same greedy tokens as one engine alone and compute none of the
prompt (its `vllm:external_prefix_cache_hits_total` grows by the prompt's tokens). Then the
prefill engine is killed: a decode leg whose KV can no longer be read recomputes the prompt
(kv_load_failure_policy recompute, which the launcher sets) and still answers the same.
Not speed: the tiny model's prefill is too cheap for P/D to win. One pair per session;
run under `flock /tmp/vllm.lock` (about 5-6 GiB, minutes to start)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.engines import VllmStart, free_port, running_vllms, tiny_spec
from tests.fixtures.polling import wait_until
from tests.gateway.faults.peers import GatewayProcess

pytestmark = pytest.mark.vllm

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 12,
    "Once upon a time, in a land far away, there lived a curious engineer who " * 8,
]
MAX_TOKENS = 9
TIMEOUT = httpx.Timeout(300.0)


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None:
        # pyproject declares nixl-cu12 for Linux x86_64 only: missing there, the install is broken
        if sys.platform == "linux" and platform.machine() == "x86_64":
            pytest.fail("nixl-cu12 is missing: pip install -e '.[dev,engine-cpu]' installs it")
        pytest.skip("no NIXL wheel for this platform")
    spec = tiny_spec(tiny_model_dir)
    spec["prefill"] = {"split": "Always", "kvConnector": {"type": "Nixl"}}
    roles = ("prefill", "decode")
    starts = [VllmStart(spec, tmp_path_factory.mktemp(role),
                        ("-m", "kubellm.engine", "--role", role,
                         "--kv-side-channel-port", str(free_port())))
              for role in roles]  # fmt: skip
    with running_vllms(starts) as urls:
        yield dict(zip(roles, urls, strict=True))


def complete(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            **extra}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def prefill_leg(url: str, prompt: str) -> dict[str, Any]:
    answer = complete(url, prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})  # fmt: skip
    params = answer.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill"), answer
    return params


def external_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.findall(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def test_decode_gives_the_same_tokens_computing_none_of_the_prompt(pair) -> None:
    for prompt in PROMPTS:
        alone = complete(pair["prefill"], prompt)  # one engine, prefill and decode
        params = prefill_leg(pair["prefill"], prompt)
        before = external_hits(pair["decode"])
        split = complete(pair["decode"], prompt, kv_transfer_params=params)
        hits = external_hits(pair["decode"]) - before
        assert split["choices"][0]["text"] == alone["choices"][0]["text"]
        assert split["usage"]["completion_tokens"] == MAX_TOKENS
        prompt_tokens = split["usage"]["prompt_tokens"]
        print(f"prompt {prompt_tokens} tokens: external prefix-cache hits on decode {hits:g}")
        assert hits == prompt_tokens


def counted(gateway: GatewayProcess, name: str, **labels: str) -> float:
    """The sum of the gateway's counter `name` over series carrying `labels`."""
    text = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    total = 0.0
    for series, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def legs(gateway: GatewayProcess, outcome: str) -> float:
    """The gateway's prefill legs with `outcome` (ok, failed)."""
    return counted(gateway, "kubellm_gateway_disagg_legs_total", role="prefill", outcome=outcome)


@pytest.fixture(scope="module")
def gateway(pair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """The kubellm gateway in front of the pair, splitting every request (`Always`)."""
    endpoints = [{"url": pair["prefill"], "role": "prefill"},
                 {"url": pair["decode"], "role": "decode"}]  # fmt: skip
    models = [{"name": "tiny", "endpoints": endpoints, "prefill": {"split": "Always"}}]
    # On a loaded machine a tiny engine's first byte can pass the default 10 s, which would
    # eject the only decode replica: the deadline here is for a hang, not for speed.
    process = GatewayProcess(
        tmp_path_factory.mktemp("gateway"), models, "--first-byte-timeout", "120"
    )
    # Until the gateway's scrapes have seen the prefill replica it prefills locally
    # (`no-prefill-replica`): wait for one split before the tests count anything.
    warm = "A request that waits for the gateway to see its prefill replica. " * 4
    wait_until(
        lambda: complete(process.url, warm) is not None and legs(process, "ok") >= 1,
        300,
        "a first request through the gateway to be split",
        interval=1,
    )
    yield process
    process.stop()


def test_through_the_gateway_the_decode_replica_computes_none_of_the_prompt(pair, gateway) -> None:
    prompt = "Requests through the gateway are split into a prefill and a decode leg. " * 6
    alone = complete(pair["prefill"], prompt)
    before, ok_before = external_hits(pair["decode"]), legs(gateway, "ok")
    answer = complete(gateway.url, prompt)
    assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
    assert external_hits(pair["decode"]) - before == answer["usage"]["prompt_tokens"]
    assert legs(gateway, "ok") == ok_before + 1


def test_a_decode_leg_whose_prefill_engine_died_still_answers(pair, gateway) -> None:
    prompt = "A decode leg outliving its prefill engine still answers the client. " * 6
    alone = complete(pair["prefill"], prompt)  # the reference, not cached on decode
    params = prefill_leg(pair["prefill"], prompt)
    _kill_listener(int(pair["prefill"].rsplit(":", 1)[1]))
    before = external_hits(pair["decode"])
    split = complete(pair["decode"], prompt, kv_transfer_params=params)
    assert split["choices"][0]["text"] == alone["choices"][0]["text"]
    print(
        f"after the prefill engine died: external hits {external_hits(pair['decode']) - before:g}"
    )

    # Through the gateway: the prefill leg to the dead engine fails (or, once the gateway's
    # scrapes have seen it gone, no leg is tried) and the decode replica prefills locally:
    # one answer, the same tokens, never a leg that succeeded.
    def local() -> float:
        gone = counted(gateway, "kubellm_gateway_disagg_decisions_total",
                       reason="no-prefill-replica")  # fmt: skip
        return legs(gateway, "failed") + gone

    before_local, ok = local(), legs(gateway, "ok")
    prompt = "With its prefill replica gone, the gateway prefills on the decode replica. " * 6
    reference = complete(pair["decode"], prompt)
    answer = complete(gateway.url, prompt)
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
    assert local() == before_local + 1
    assert legs(gateway, "ok") == ok


def _kill_listener(port: int) -> None:
    """Stop the prefill engine (the launcher started by the fixture, by its port)."""
    import signal

    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if (
            conn.laddr
            and conn.laddr.port == port
            and conn.status == psutil.CONN_LISTEN
            and conn.pid
        ):
            server = psutil.Process(conn.pid)
            for process in [*server.children(recursive=True), server]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    os.kill(process.pid, signal.SIGKILL)
            psutil.wait_procs([server], timeout=60)
            return
    pytest.fail(f"no process listens on {port}")
