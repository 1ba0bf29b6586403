"""The OpenAI request as the gateway reads it: the two completion routes and their bodies.

`parse_body` checks the fields routing relies on and nothing more (the engine checks
the rest). Anything the gateway could not process is refused here, with a 400 in
OpenAI's envelope, before any routing code sees it: invalid JSON or UTF-8, a lone
surrogate escape (`"\\ud800"`, which no UTF-8 encoder accepts), nesting deeper than
`MAX_DEPTH`, or a field of the wrong type. A client's `kv_transfer_params` is refused
too: they tell an engine where to pull KV blocks from, which only the gateway's prefill
leg may say.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from kubellm.gateway.protocol import errors
from kubellm.gateway.protocol.errors import GatewayError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PATHS = (CHAT, COMPLETIONS)

# Deeper than any real request (tool schemas included), far under Python's recursion limit.
MAX_DEPTH = 64
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_DECODER = json.JSONDecoder()  # what `json.loads` decodes with (no arguments)


def _loads(raw: bytes) -> Any:
    """`json.loads(raw)`: a body opening with `{` and no NUL after it is UTF-8 by
    `json.detect_encoding`'s rules, decoded here without running them."""
    if raw[:1] == b"{" and raw[1:2] != b"\0":
        return _DECODER.decode(raw.decode("utf-8", "surrogatepass"))
    return json.loads(raw)


def parse_body(raw: bytes, path: str) -> dict[str, Any]:
    """Parse and check the fields the gateway relies on; the rest passes through unchecked.

    Raises `GatewayError` (400) for anything the gateway cannot process."""
    try:
        body = _loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except UnicodeDecodeError:
        raise errors.bad_request("Request body is not valid UTF-8.") from None
    except ValueError as error:
        raise errors.bad_request(f"Request body is not valid JSON: {error}") from None
    # Cheap guards first: only a body with many brackets can be deep, only one with a
    # surrogate escape can hold a lone surrogate. (Whether json.loads itself gives up on
    # deep nesting depends on the process's recursion limit, which libraries raise.)
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(body) > MAX_DEPTH:
        raise _too_deep()
    if not isinstance(body, dict):
        raise errors.bad_request("Request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise errors.bad_request(
                "Request body holds a lone UTF-16 surrogate escape (e.g. \\ud800): "
                "text must be valid Unicode."
            ) from None
    if "kv_transfer_params" in body:
        # They name the host and port an engine pulls KV blocks from; only the gateway's
        # own prefill leg sets them (protocol/kv_transfer.py).
        raise errors.bad_request(
            "`kv_transfer_params` is set by the gateway for split requests, not by clients.",
            "kv_transfer_params",
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request("`model` is required and must be a non-empty string.", "model")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise errors.bad_request("`stream` must be a boolean.", "stream")
    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise errors.bad_request("`messages` must be a non-empty array.", "messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise errors.bad_request("Each message must be an object with a `role`.", "messages")
    elif "prompt" not in body:
        raise errors.bad_request("`prompt` is required.", "prompt")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise errors.bad_request(f"`{name}` must be a positive integer.", name)
    temperature = body.get("temperature")
    if temperature is not None and (
        not isinstance(temperature, int | float)
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise errors.bad_request("`temperature` must be a number >= 0.", "temperature")
    return body


def _too_deep() -> GatewayError:
    return errors.bad_request(f"Request body is nested deeper than {MAX_DEPTH} levels.")


def _depth(value: Any) -> int:
    """How deep arrays and objects nest in `value` (iterative: no recursion limit)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest
