"""P/D disaggregation through the HTTP front end, against loopback engines that speak vLLM's
`kv_transfer_params`: the prefill leg, the decode leg carrying its params, and the fallback
to local prefill when the prefill engine fails, hangs or answers garbage."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kubellm.gateway.discovery.base import CanarySplit, Endpoint, PrefillSplit
from kubellm.gateway.routing.settings import Thresholds

from kubellm.api import SLO
from tests.fixtures.polling import wait_until
from tests.gateway.conftest import model

LABELS = {"model": "tiny", "namespace": "default", "deployment": "tiny"}
LONG = [{"role": "user", "content": "lorem ipsum " * 4000}]  # ~12k tokens
SHORT = [{"role": "user", "content": "hello"}]


def _pd(prefill_url: str, decode_url: str, split: str = "Always", slo: SLO | None = None):
    target = model("tiny", [decode_url], slo=slo)
    return replace(
        target,
        endpoints=(Endpoint(prefill_url, role="prefill"), Endpoint(decode_url, role="decode")),
        prefill=PrefillSplit(split),  # type: ignore[arg-type]
    )


def _legs(gw, outcome: str) -> float:
    return gw.metric("kubellm_gateway_disagg_legs_total", **LABELS, role="prefill",
                     outcome=outcome)  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_a_split_request_prefills_on_the_prefill_role_and_decodes_with_its_kv(
    engines, gateway, stream
):
    (pre, pre_server), (dec, dec_server) = engines(2)
    gw = gateway({"tiny": _pd(pre_server.url, dec_server.url)})
    answer = gw.client().chat.completions.create(model="tiny", messages=SHORT, stream=stream)
    text = "".join(c.choices[0].delta.content or "" for c in answer) if stream else (
        answer.choices[0].message.content)  # fmt: skip
    assert text.startswith(dec.name)  # one answer, the decode replica's
    (leg,) = pre.bodies
    assert leg["max_tokens"] == 1 and leg["stream"] is False and "stream_options" not in leg
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["kv_transfer_params"]["do_remote_prefill"] is False
    (decode,) = dec.bodies
    params = decode["kv_transfer_params"]
    assert params["remote_engine_id"] == pre.name and params["do_remote_prefill"] is True
    assert decode["messages"] == SHORT and decode.get("max_tokens") != 1
    assert _legs(gw, "ok") == 1
    assert gw.metric("kubellm_gateway_disagg_decisions_total", **LABELS, split="true",
                     reason="always") == 1  # fmt: skip


@pytest.mark.parametrize("failure", ["status", "garbage", "none", "hang", "down"])
def test_a_failed_prefill_leg_falls_back_to_local_prefill(engines, gateway, failure):
    (pre, pre_server), (dec, dec_server) = engines(2)
    if failure == "status":
        pre.behaviour.status = 500
    elif failure == "hang":
        pre.behaviour.first_byte_delay = 120.0
    elif failure == "down":
        pre_server.stop()
    else:
        pre.behaviour.prefill_answer = failure
    slo = SLO(ttft_seconds=0.5, itl_seconds=0.1)
    gw = gateway({"tiny": _pd(pre_server.url, dec_server.url, slo=slo)})
    answer = gw.client(timeout=60).chat.completions.create(model="tiny", messages=SHORT)
    assert answer.choices[0].message.content.startswith(dec.name)
    (decode,) = dec.bodies
    assert "kv_transfer_params" not in decode  # computed locally, the body as sent
    assert _legs(gw, "failed") == 1 and _legs(gw, "ok") == 0


def test_conditional_splits_a_long_prompt_on_a_queued_decode_replica_only(engines, gateway):
    (pre, pre_server), (dec, dec_server) = engines(2)
    dec.behaviour.running = 40
    dec.behaviour.waiting = 50  # a queue there (other gateways'), the prefill replica idle
    slo = SLO(ttft_seconds=2.0, itl_seconds=0.03)
    gw = gateway(  # the queue there is not saturation here: a prediction's input
        {"tiny": _pd(pre_server.url, dec_server.url, "Conditional", slo)},
        thresholds=Thresholds(max_waiting=1000),
    )
    load = gw.gateway.load
    wait_until(lambda: all(load.stats(s.url) is not None for s in (pre_server, dec_server)), 60)
    client = gw.client()
    client.chat.completions.create(model="tiny", messages=SHORT)
    client.chat.completions.create(model="tiny", messages=LONG)
    assert len(pre.bodies) == 1 and pre.bodies[0]["messages"] == LONG
    assert [("kv_transfer_params" in b) for b in dec.bodies] == [False, True]
    decisions = "kubellm_gateway_disagg_decisions_total"
    assert gw.metric(decisions, **LABELS, split="false", reason="short-prompt") == 1
    assert gw.metric(decisions, **LABELS, split="true", reason="faster-ttft") == 1


def test_a_prefill_replica_never_takes_a_whole_request(engines, gateway):
    (pre, pre_server), (dec, dec_server) = engines(2)
    target = replace(_pd(pre_server.url, dec_server.url), prefill=None)  # no split at all
    gw = gateway({"tiny": target})
    for _ in range(4):
        gw.client().chat.completions.create(model="tiny", messages=SHORT)
    assert pre.bodies == [] and len(dec.bodies) == 4


def test_both_legs_of_a_canary_request_stay_on_the_canary_revision(engines, gateway):
    (pre, pre_server), (pre_canary, pre_canary_server), (dec, dec_server) = engines(3)
    target = replace(
        _pd(pre_server.url, dec_server.url),
        endpoints=(
            Endpoint(pre_server.url, role="prefill"),
            Endpoint(pre_canary_server.url, role="prefill", revision="r2"),
            Endpoint(dec_server.url, role="decode", revision="r2"),
        ),
        canary=CanarySplit("r2", 100),
    )
    gw = gateway({"tiny": target})
    for _ in range(3):
        gw.client().chat.completions.create(model="tiny", messages=SHORT)
    assert len(dec.bodies) == 3 and len(pre_canary.bodies) == 3
    assert pre.bodies == []  # never the stable revision's prefill replica


def test_a_revision_without_prefill_replicas_prefills_locally(engines, gateway):
    (pre, pre_server), (dec, dec_server) = engines(2)
    target = replace(
        _pd(pre_server.url, dec_server.url),
        endpoints=(
            Endpoint(pre_server.url, role="prefill"),
            Endpoint(dec_server.url, role="decode", revision="r2"),
        ),
        canary=CanarySplit("r2", 100),
    )
    gw = gateway({"tiny": target})
    gw.client().chat.completions.create(model="tiny", messages=SHORT)
    assert pre.bodies == [] and "kv_transfer_params" not in dec.bodies[0]
    assert gw.metric("kubellm_gateway_disagg_decisions_total", **LABELS, split="false",
                     reason="no-prefill-replica") == 1  # fmt: skip
