"""A large valid static file is re-read off the event loop: requests keep being served
while it is parsed (it held the loop for 1.74 s at 3 MiB)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import yaml
from kubellm.gateway.discovery.static import StaticDiscovery

from tests.fixtures.polling import eventually


def big_file(path: Path, tag: str) -> None:
    """A valid file of ~2.5 MiB: one model with 2,500 adapters of 1 KiB paths (values stay
    under the reader's 10,000-value bound)."""
    adapters = {f"{tag}-a{i}": "/models/" + "p" * 1000 + str(i) for i in range(2500)}
    models = [{"name": "m", "endpoints": ["http://127.0.0.1:8000"], "adapters": adapters}]
    path.write_text(yaml.safe_dump({"models": models}))


async def test_a_big_reload_leaves_the_loop_free(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    big_file(path, "old")
    discovery = StaticDiscovery(path, poll_seconds=0.01)
    ticks = 0
    during: list[int] = []
    reload = discovery.reload

    def measured() -> bool:
        start = ticks
        try:
            return reload()
        finally:
            during.append(ticks - start)

    discovery.reload = measured  # type: ignore[method-assign]
    changed = asyncio.Event()
    task = asyncio.create_task(discovery.run(changed.set))
    try:
        await eventually(lambda: during, 10, "a first poll")
        big_file(path, "new")
        os.utime(path, ns=(1, 1))  # a new modification time, whatever the clock's grain
        stop = asyncio.get_running_loop().time() + 30
        while not changed.is_set() and asyncio.get_running_loop().time() < stop:
            ticks += 1  # another request's turn on the loop
            await asyncio.sleep(0)
        assert changed.is_set(), "the file was not reloaded"
        assert "new-a0" in {a.name for a in discovery.snapshot()["m"].adapters}
        assert max(during) > 0, "the loop ran nothing while the file was parsed"
    finally:
        task.cancel()
