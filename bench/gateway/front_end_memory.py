"""Memory per replica of a front end's routing state: the precise KV index and the adapters.

Both front ends (`kubellm gateway`, `kubellm epp`) hold, per replica of a model, the
precise index's block entries (gateway/routing/index/kv_events.py: one per KV block the replica's
events say it holds) and the adapter view (gateway/routing/replicas/adapters.py: the adapters a
replica has registered, the LRU of those this front end sent there). This measures both
with tracemalloc on the real classes, filled as a full replica would fill them, and prints
bytes per entry and MiB per replica, for the sizing table in docs/operations.md.

    python -m bench.front_end_memory
    python -m bench.front_end_memory --kv-gib 64 --kv-bytes-per-token 131072 --adapters 100
"""

from __future__ import annotations

import argparse
import tracemalloc
from collections.abc import Callable

from kubellm.gateway.routing.index.kv_events import KVIndex
from kubellm.gateway.routing.replicas.adapters import AdapterView


def measured(build: Callable[[], object]) -> int:
    """Bytes `build` leaves allocated (its result kept alive while the snapshot is taken)."""
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    kept = build()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    del kept
    return sum(s.size_diff for s in after.compare_to(before, "filename"))


def kv_index(replicas: int, blocks: int) -> KVIndex:
    """Every replica holding `blocks` distinct blocks (no block shared: the worst case)."""
    index = KVIndex()
    base = 1 << 63  # 64-bit hashes, as vLLM publishes them
    chunk = 1000
    for r in range(replicas):
        url = f"http://r{r}:8000"
        for seq, start in enumerate(range(0, blocks, chunk)):
            hashes = range(
                base + r * blocks + start, base + r * blocks + min(blocks, start + chunk)
            )
            index.apply(url, seq, [0.0, [{"type": "BlockStored", "block_hashes": list(hashes)}], 0])
    assert index.entries() == replicas * blocks
    return index


def adapter_view(replicas: int, adapters: int, slots: int) -> AdapterView:
    """Every replica with `adapters` registered and `slots` of them sent there lately."""
    view = AdapterView(clock=lambda: 0.0)
    names = [f"team-{i:03d}-adapter" for i in range(adapters)]
    for r in range(replicas):
        url = f"http://r{r}:8000"
        view.record_registered(url, names)
        for name in names[:slots]:
            view.sent(url, name, slots)
    return view


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--kv-gib", type=float, default=64.0, help="KV pool per replica")
    parser.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=128 * 1024,
        help="Llama 3 8B bf16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=100, help="registered per replica")
    parser.add_argument("--slots", type=int, default=4, help="maxLoras")
    a = parser.parse_args()

    blocks = int(a.kv_gib * 2**30 // a.kv_bytes_per_token // a.block_size)
    used = measured(lambda: kv_index(a.replicas, blocks))
    per_entry = used / (a.replicas * blocks)
    print(
        f"precise KV index: {a.replicas} replicas x {blocks:,} blocks ({a.kv_gib:g} GiB of KV "
        f"at {a.kv_bytes_per_token:,} B/token, {a.block_size}-token blocks): "
        f"{per_entry:.0f} B per entry, {used / a.replicas / 2**20:.1f} MiB per replica, "
        f"{used / 2**20:.1f} MiB in all"
    )
    used = measured(lambda: adapter_view(a.replicas, a.adapters, a.slots))
    print(
        f"adapter view: {a.replicas} replicas x {a.adapters} registered adapters, {a.slots} "
        f"slots: {used / a.replicas / 1024:.1f} KiB per replica, {used / 2**20:.2f} MiB in all"
    )


if __name__ == "__main__":
    main()
