"""Token counts from request bodies and checked upstream `usage` (gateway/protocol/usage.py)."""

from __future__ import annotations

import json

import pytest
from kubellm.gateway.protocol import usage
from kubellm.gateway.routing.flow.queues import estimate_prompt_tokens


@pytest.mark.parametrize(
    ("body", "bound"),
    [
        ({"max_tokens": 300}, 300),
        ({"max_completion_tokens": 50, "max_tokens": 300}, 50),
        ({"max_tokens": 10, "n": 3}, 30),
        ({"max_tokens": 10, "n": 2, "best_of": 4}, 40),
        ({}, usage.DEFAULT_OUTPUT_BOUND),
        ({"max_tokens": 0}, usage.DEFAULT_OUTPUT_BOUND),
        ({"max_tokens": -5}, usage.DEFAULT_OUTPUT_BOUND),
        ({"max_tokens": True}, usage.DEFAULT_OUTPUT_BOUND),
        ({"max_tokens": 1.5e300}, usage.DEFAULT_OUTPUT_BOUND),
        (None, usage.DEFAULT_OUTPUT_BOUND),
    ],
)
def test_output_bound(body, bound):
    assert usage.output_bound(body) == bound


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [(list(range(2000)), 2000), ([list(range(2000))], 2000), ([[1, 2], [3]], 3),
     (["x" * 400], 100), ("x" * 400, 100)],
)  # fmt: skip
def test_token_id_prompts_count_their_ids(prompt, tokens):
    assert estimate_prompt_tokens({"prompt": prompt}) == tokens


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ('{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}', {"prompt": 3, "completion": 4}),
        ('{"usage": {"completion_tokens": 4}}', {"prompt": 0, "completion": 4}),
        ('{"usage": {"prompt_tokens": -1, "completion_tokens": 4}}', None),
        ('{"usage": {"prompt_tokens": 1e999}}', None),
        ('{"usage": {"prompt_tokens": Infinity}}', None),
        ('{"usage": {"prompt_tokens": NaN}}', None),
        ('{"usage": {"prompt_tokens": 3.0}}', None),
        ('{"usage": {"prompt_tokens": true}}', None),
        ('{"usage": {"prompt_tokens": 99999999999999}}', None),
        ('{"usage": null}', None),
        ('{"usage": [1]}', None),
        ("[1, 2]", None),
        ("not json", None),
    ],
)
def test_usage_figures_are_checked(text, counts):
    assert usage.parse(text.encode()) == counts


def _event(data: dict) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def test_the_usage_event_is_dropped_however_the_stream_is_cut():
    token = _event({"choices": [{"index": 0, "text": "hi"}]})
    tail = _event({"choices": [{"index": 0, "text": "!"}], "usage": {"prompt_tokens": 1}})
    only = _event({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}})
    stream = token + tail + only + b"data: [DONE]\n\n"
    expected = token + b'data: {"choices":[{"index":0,"text":"!"}]}\n\n' + b"data: [DONE]\n\n"
    for cut in (1, 7, 64, len(stream)):  # pieces of every size: events split across them
        strip = usage.UsageStrip()
        out = b"".join(strip.feed(stream[i : i + cut]) for i in range(0, len(stream), cut))
        assert out + strip.end() == expected
    plain = usage.UsageStrip()
    assert plain.feed(token) == token  # nothing to take out: the piece as it came
