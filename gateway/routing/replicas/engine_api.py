"""vLLM's runtime adapter API: the only requests the routing core sends to engines besides
its scrapes.

The routing core decides where an adapter is loaded (`routing.replicas.adapters`); these send
the requests, for both front ends (the scheduler wires them to its client in `start`, so
the standalone proxy and the endpoint picker load adapters alike): POST
`/v1/load_lora_adapter` {lora_name, lora_path} and `/v1/unload_lora_adapter` {lora_name}
(vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING, which the launcher sets, or the simulator).
An adapter the replica already has counts as loaded; one it no longer has counts as
unloaded.
"""

from __future__ import annotations

import json

import aiohttp

from kubellm import bounded

# vLLM refuses these requests without it (400, "Unsupported Media Type"); the gateway's
# client adds no Content-Type of its own (relay.new_session skips it), so it is set here.
_JSON = {"Content-Type": "application/json"}
# The caller bounds a load (`AdapterLoads.timeout`, 60 s): reading an adapter from disk may
# take longer than the client's default total (the endpoint picker's is 5 s, for scrapes).
_UNBOUNDED = aiohttp.ClientTimeout(total=None, sock_connect=5)


# An answer to a load or unload is a line of JSON: more is a broken (or hostile) replica.
MAX_ANSWER_BYTES = 64 * 1024


class AdapterRequestFailed(RuntimeError):
    """The replica refused a load or unload; the message is its answer."""


async def _text(response: aiohttp.ClientResponse) -> str:
    body = await bounded.read_capped(
        response.content.iter_any(), MAX_ANSWER_BYTES, response.content_length
    )
    return body.decode("utf-8", "replace")


async def load_adapter(client: aiohttp.ClientSession, url: str, name: str, path: str) -> None:
    body = json.dumps({"lora_name": name, "lora_path": path})
    async with client.post(
        f"{url}/v1/load_lora_adapter", data=body, headers=_JSON, timeout=_UNBOUNDED
    ) as response:
        text = await _text(response)
        if response.status == 200 or (response.status == 400 and "already been loaded" in text):
            return
        raise AdapterRequestFailed(f"{url}: loading {name!r}: {response.status} {text[:200]}")


async def unload_adapter(client: aiohttp.ClientSession, url: str, name: str) -> None:
    body = json.dumps({"lora_name": name})
    async with client.post(
        f"{url}/v1/unload_lora_adapter", data=body, headers=_JSON, timeout=_UNBOUNDED
    ) as response:
        text = await _text(response)
        if response.status in (200, 404):  # 404: it is gone already
            return
        raise AdapterRequestFailed(f"{url}: unloading {name!r}: {response.status} {text[:200]}")
