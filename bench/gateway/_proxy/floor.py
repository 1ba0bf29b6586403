"""The floor of a Python gateway on kubellm's own stack (--peers python-floor): uvicorn
(httptools, uvloop) serving a bare ASGI app that reads the body, sends it to the one
backend through the gateway's own upstream `Pool`, and returns the answer whole. No
admission, no routing, no metrics, no tenancy: what any gateway written on this stack
costs per non-streamed request before it decides anything.

    python bench/gateway/_proxy/floor.py BACKEND_PORT LISTEN_PORT
"""

from __future__ import annotations

import sys

import uvicorn
from kubellm.gateway.http.upstream import Pool


def app_for(backend: str):
    pool = Pool(connect_timeout=5.0)

    async def app(scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        response = await pool.post(backend + scope["path"], b"".join(chunks), {})
        try:
            body = await response.read()
        finally:
            response.close()  # pools the connection when the answer was read to its end
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    return app


if __name__ == "__main__":
    backend_port, port = int(sys.argv[1]), int(sys.argv[2])
    uvicorn.run(
        app_for(f"http://127.0.0.1:{backend_port}"), host="127.0.0.1", port=port,
        loop="uvloop", http="httptools", log_level="warning", access_log=False,
    )  # fmt: skip
