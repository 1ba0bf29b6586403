"""The simulator's KV-cache event publisher: vLLM's `ZmqEventPublisher` protocol on pyzmq.

A PUB socket sends each step's batch as (topic, 8-byte big-endian sequence number,
msgpack EventBatch); a ROUTER socket answers replay requests (empty frame, 8-byte start
sequence) with every buffered batch from that sequence on, then the end marker (seq -1),
as vLLM does (kubellm.kv_blocks says the format). Sequence numbers start at 0 with each
process, so a subscriber sees a restart as numbering that goes back. The last
`buffer_steps` batches are kept for replay (vLLM's default, 10,000).

Endpoints follow the launcher's `kv_events_args`: the PUB socket on the port, the replay
socket on the next one, on the simulator's host.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from kubellm import kv_blocks

log = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(
        self, host: str, port: int, *, topic: str = "", buffer_steps: int = 10_000
    ) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._topic = topic.encode()
        self._seq = itertools.count()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        bind_host = "*" if host in ("", "0.0.0.0", "::") else host
        self.publish_endpoint = f"tcp://{bind_host}:{port}"
        self.replay_endpoint = f"tcp://{bind_host}:{port + 1}"
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(self.publish_endpoint)
            self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as error:
            self.close()
            raise ValueError(
                f"KV events: cannot bind {self.publish_endpoint} / {self.replay_endpoint}: {error}"
            ) from None
        self._task: asyncio.Task[None] | None = None
        self.published = 0

    def start(self) -> None:
        """Serve replay requests (call from the event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[dict[str, Any]], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        seq = next(self._seq)
        payload = kv_blocks.encode_batch(time.time() if ts is None else ts, events)
        self._buffer.append((seq, payload))
        # PUB never blocks: past the high-water mark a slow subscriber loses batches and
        # finds the gap by their numbers, then replays them
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
        self.published += 1
        return seq

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await self._replay.send_multipart(
                (client, b"", b"", kv_blocks.seq_bytes(kv_blocks.END_SEQ), b"")
            )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.close()

    def close(self) -> None:
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()
