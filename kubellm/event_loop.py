"""The event loop a kubellm server runs on: uvloop's when installed (what `uvicorn.run`
would pick; fewer instructions per request than asyncio's, docs/operations.md), else
asyncio's. An environment variable set to `asyncio` forces asyncio's loop."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable


def loop_factory(env_var: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """For `asyncio.Runner(loop_factory=...)`: uvloop's loop, or None (asyncio's default)
    when uvloop is missing or `env_var` is `asyncio`."""
    if os.environ.get(env_var) == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
