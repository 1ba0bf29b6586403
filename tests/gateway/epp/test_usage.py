"""A tenant's stream through the real Envoy and `kubellm epp` is settled on the replica's
own token counts (issue 39, item 7): the picker asks the replica for usage
(`stream_options.include_usage`, a request body mutation) on every tenant stream, reads
it from the answer, and drops the usage event from the client's stream where the client
did not ask for it. Token-id prompts are counted by their ids. The replica is a loopback
OpenAI-compatible engine reporting the ids it received."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml
from kubellm.gateway.routing.flow import tenants

from tests.fixtures.engines import wait_until
from tests.fixtures.servers import ServerThread
from tests.gateway.http.test_quota_charging import UsageEngine

KEY = "sk-meter"
IDS = list(range(1, 2001))  # the engine reports 2,000 prompt tokens and 1 completion token
DEADLINE_S = 60.0


def _served(stack) -> float:
    return sum(
        stack.metric("kubellm_gateway_tenant_tokens_total", tenant="meter", kind=kind)
        for kind in ("prompt", "completion")
    )


@pytest.fixture
def usage_stack(envoy_stack, tmp_path: Path):
    servers: list[ServerThread] = []

    def start(tokens_per_minute: int = 10**6, **modes: str):
        engine = UsageEngine()
        server = ServerThread(engine.app()).start()
        servers.append(server)
        declared = tmp_path / "tenants.yaml"
        declared.write_text(yaml.safe_dump({"tenants": [{
            "name": "meter", "tokensPerMinute": tokens_per_minute,
            "apiKeys": [f"sha256:{tenants.digest(KEY)}"],
        }]}))  # fmt: skip
        stack = envoy_stack(
            [{"name": "tiny", "endpoints": [server.url]}],
            epp_args=("--tenants", str(declared)),
            **modes,
        )
        return engine, stack

    yield start
    for server in servers:
        server.stop()


def _post(stack, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(
        f"{stack.url}{path}",
        json={"model": "tiny", **body},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=DEADLINE_S,
    )


MODES = {
    "buffered": {},  # the bootstrap's defaults: request BUFFERED, response STREAMED
    "full-duplex": {
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
    },
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_tenant_stream_is_settled_on_the_replicas_usage_through_envoy(usage_stack, mode):
    """Without `include_usage` the tenant was charged the picker's estimate; now the replica
    is asked for usage (its body says so), the tenant is charged its figures (2,000 ids
    and one token), and the client's stream has no usage event, as it asked. A client that
    asked gets the event, and is charged the same."""
    engine, stack = usage_stack(**MODES[mode])
    plain = _post(stack, {"prompt": [IDS], "max_tokens": 1, "stream": True})
    assert plain.status_code == 200, plain.text
    assert engine.bodies[-1]["stream_options"] == {"include_usage": True}
    assert engine.bodies[-1]["prompt"] == [IDS]  # the rest of the body as the client sent it
    assert '"usage"' not in plain.text
    events = [line for line in plain.text.splitlines() if line]
    assert events[-1] == "data: [DONE]" and len(events) == 2, plain.text  # the token, the end
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "hi"
    wait_until(lambda: _served(stack) == 2001, DEADLINE_S, "the stream settled on its usage")

    asked = _post(
        stack,
        {"prompt": [IDS], "stream": True, "stream_options": {"include_usage": True}},
    )
    assert asked.status_code == 200
    usages = [json.loads(line[6:])["usage"] for line in asked.text.splitlines()
              if line.startswith("data: {") and '"usage"' in line]  # fmt: skip
    assert usages == [{"prompt_tokens": 2000, "completion_tokens": 1}]
    wait_until(lambda: _served(stack) == 4002, DEADLINE_S, "the second stream settled")

    chat = _post(
        stack,
        {"messages": [{"role": "user", "content": "hello"}], "stream": True},
        "/v1/chat/completions",
    )
    assert chat.status_code == 200 and '"usage"' not in chat.text
    assert engine.bodies[-1]["stream_options"] == {"include_usage": True}
    wait_until(lambda: _served(stack) == 4006, DEADLINE_S, "the chat stream settled")


def test_token_id_prompts_are_counted_by_their_ids_through_the_picker(usage_stack):
    """A tenant of 1,000 tokens a minute: a prompt of 2,000 ids is 2,000 tokens at
    admission (not one per list), so the first of the minute is served and the next one is
    refused, nested (`[[ids]]`) or flat (`[ids]`)."""
    from tests.gateway.http.test_tenancy import within_one_minute

    _engine, stack = usage_stack(tokens_per_minute=1000)
    within_one_minute()
    nested = {"prompt": [IDS], "max_tokens": 1, "stream": True}
    assert _post(stack, nested).status_code == 200
    refused = _post(stack, nested)
    assert refused.status_code == 429, refused.text
    assert _post(stack, {"prompt": IDS, "max_tokens": 1}).status_code == 429
