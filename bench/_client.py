"""The benchmarks' streamed OpenAI client: one request, timed at the client.

`stream` posts a body with `"stream": true` and reads the answer's server-sent events:
each `data:` event whose first choice carries text (a chat's `delta.content`, a
completion's `text`) is a token; TTFT is the first one's arrival, ITL the mean gap after
it. A refusal, a transport error or an answer with no text is `ok: False` with why.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

CHAT = "/v1/chat/completions"


def text_of(event: str) -> str:
    """The text a streamed event carries ("" for the role chunk, usage, [DONE], an error)."""
    try:
        choices = json.loads(event).get("choices") or [{}]
    except (ValueError, AttributeError):
        return ""
    choice = choices[0]
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


async def stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    path: str = CHAT,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One streamed request to `url + path`: `{"ok": True, "ttft", "itl", "tokens", "text",
    "end"}` (seconds, `time.monotonic` for `end`; `itl` 0 for one token), else `{"ok": False,
    "status": the HTTP status, the error's name or "empty"}` with the refused `response`."""
    start = time.monotonic()
    times: list[float] = []
    pieces: list[str] = []
    try:
        async with client.stream(
            "POST", f"{url}{path}", json={**body, "stream": True}, headers=headers
        ) as response:
            if response.status_code != 200:
                await response.aread()
                return {"ok": False, "status": response.status_code, "response": response}
            async for line in response.aiter_lines():
                if line.startswith("data:") and (piece := text_of(line[5:].strip())):
                    times.append(time.monotonic())
                    pieces.append(piece)
    except httpx.HTTPError as error:
        return {"ok": False, "status": type(error).__name__}
    if not times:
        return {"ok": False, "status": "empty"}
    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return {"ok": True, "ttft": times[0] - start, "itl": itl, "tokens": len(times),
            "text": "".join(pieces), "end": time.monotonic()}  # fmt: skip
