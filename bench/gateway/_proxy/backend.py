"""A near-zero-latency OpenAI-compatible backend: raw asyncio HTTP/1.1 keep-alive.

    python bench/gateway/_proxy/backend.py PORT [PORT ...]

Non-streamed requests get a fixed chat completion at once; streamed ones (`"stream":
true`) get `bench_chunks` SSE chunks `bench_itl_ms` apart (the first at once), then
`data: [DONE]`. `GET /metrics` answers vLLM's token counters (`vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`), moved by every answer as an engine's are, so the gateway's
default forwards non-streamed requests whole here as it would to vLLM. Anything else not a
POST gets an empty 200 (the health probe). SIGINT stops it.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import sys

COMPLETION = json.dumps({
    "id": "c", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}).encode()  # fmt: skip
JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(COMPLETION)).encode()
    + b"\r\n\r\n"
    + COMPLETION
)
EMPTY = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 0\r\n\r\n"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENT = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
)
DONE = b"data: [DONE]\n\n"
CHUNKS = re.compile(rb'"bench_chunks":\s*(\d+)')
ITL = re.compile(rb'"bench_itl_ms":\s*([\d.]+)')
STREAM = re.compile(rb'"stream":\s*true')


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


TOKENS = [0]  # tokens answered so far, all connections


def metrics() -> bytes:
    text = (
        "# TYPE vllm:prompt_tokens counter\n"
        f'vllm:prompt_tokens_total{{model_name="m"}} {TOKENS[0]}\n'
        "# TYPE vllm:generation_tokens counter\n"
        f'vllm:generation_tokens_total{{model_name="m"}} {TOKENS[0]}\n'
    ).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (
        len(text),
        text,
    )


class Server(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            if b"transfer-encoding: chunked" in head:  # Envoy may send bodies chunked
                tail = self.buf.find(b"\r\n0\r\n\r\n", end)
                if tail < 0:
                    return
                raw, body, k = self.buf[end + 4 : tail + 2], b"", 0
                while k < len(raw):
                    nl = raw.find(b"\r\n", k)
                    size = int(raw[k:nl].split(b";")[0], 16)
                    body += raw[nl + 2 : nl + 2 + size]
                    k = nl + 2 + size + 2
                self.buf = self.buf[tail + 7 :]
                self.handle(head, body)
                continue
            i = head.find(b"content-length:")
            length = 0
            if i >= 0:
                j = head.find(b"\r\n", i)
                length = int(head[i + 15 : j if j > 0 else None])
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            self.handle(head, body)

    def handle(self, head: bytes, body: bytes) -> None:
        if not head.startswith(b"post"):
            self.t.write(metrics() if head.startswith(b"get /metrics") else EMPTY)
            return
        TOKENS[0] += 1
        if not STREAM.search(body):
            self.t.write(JSON_RESPONSE)
            return
        found = CHUNKS.search(body)
        chunks = int(found.group(1)) if found else 8
        found = ITL.search(body)
        itl = float(found.group(1)) / 1000 if found else 0.0
        self.t.write(SSE_HEAD + chunk(EVENT))
        loop = asyncio.get_running_loop()

        def send(left: int) -> None:
            if self.t.is_closing():
                return
            if left == 0:
                self.t.write(chunk(DONE) + b"0\r\n\r\n")
                return
            self.t.write(chunk(EVENT))
            if itl:
                loop.call_later(itl, send, left - 1)
            else:
                send(left - 1)

        if itl:
            loop.call_later(itl, send, chunks - 1)
        else:
            send(chunks - 1)


async def main(ports: list[int]) -> None:
    """Serve on each loopback port (one per replica the gateway is given) until a signal."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    servers = [await loop.create_server(Server, "127.0.0.1", p, backlog=1024) for p in ports]
    await stop.wait()
    for server in servers:
        server.close()


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        asyncio.run(main([int(a) for a in sys.argv[1:]]))
    else:
        uvloop.run(main([int(a) for a in sys.argv[1:]]))
