"""The two legs of a split request as vLLM's KV connectors expect them (pure).

vLLM 0.32's NixlConnector (`kv_connector/v1/nixl/pull_scheduler.py`) and its disaggregated
proxy example: the prefill leg is the client's request with `max_tokens: 1`, not streamed,
and `kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false, ...}`; the
prefill engine computes the prompt, keeps its KV blocks for the decode engine and answers
`kv_transfer_params` naming them (`do_remote_prefill: true`, `remote_engine_id`,
`remote_block_ids`, `remote_host`, `remote_port`, `remote_request_id`, `tp_size`). The
decode leg is the client's request carrying those params: the decode engine pulls the
blocks and computes none of the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_PARAMS_BYTES", "decode_body", "kv_params_of", "prefill_body"]

# The returned params' size at most (a block id per 16 tokens of a 128k-token prompt is
# ~50 KiB of JSON): more is a hostile or broken engine.
MAX_PARAMS_BYTES = 256 * 1024

_ASK = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: Mapping[str, Any]) -> bytes:
    """The prefill leg's body: the request computing its prompt and one token, whole."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "n", "best_of")}
    leg.update(stream=False, max_tokens=1, kv_transfer_params=dict(_ASK))
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return json.dumps(leg, ensure_ascii=False).encode()


def kv_params_of(answer: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill engine's answer; None when the answer is not
    one (not JSON, no params, params not naming a remote prefill, too large)."""
    try:
        document = json.loads(answer)
    except (ValueError, RecursionError):
        return None
    params = document.get("kv_transfer_params") if isinstance(document, dict) else None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    if len(json.dumps(params)) > MAX_PARAMS_BYTES:
        return None
    return params


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> bytes:
    """The decode leg's body: the client's request carrying the prefill's params."""
    return json.dumps({**body, "kv_transfer_params": dict(params)}, ensure_ascii=False).encode()
