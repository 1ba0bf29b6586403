"""The gateway under an instrument, in its own process:

    python bench/gateway/_proxy/instrumented.py profile FILE GATEWAY-ARGS...   # cProfile stats
    python bench/gateway/_proxy/instrumented.py gc FILE GATEWAY-ARGS...        # cyclic-GC pauses

`profile`: the stats are written to FILE when the gateway stops. `gc`: one JSON line per
collection (CLOCK_MONOTONIC start, seconds paused, generation), written when it stops.
"""

from __future__ import annotations

import cProfile
import gc
import json
import sys
import time
from typing import Any

from kubellm.gateway import cli


def profiled(out: str, argv: list[str]) -> None:
    profile = cProfile.Profile()
    try:
        profile.runcall(cli.main, argv)
    finally:
        profile.dump_stats(out)


def gc_logged(out: str, argv: list[str]) -> None:
    log: list[tuple[float, float, int]] = []
    began = [0.0]

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.monotonic()
        else:
            log.append((began[0], time.monotonic() - began[0], info["generation"]))

    gc.callbacks.append(note)
    try:
        cli.main(argv)
    finally:
        with open(out, "w") as handle:
            handle.writelines(json.dumps(entry) + "\n" for entry in log)


if __name__ == "__main__":
    mode, out, *rest = sys.argv[1:]
    {"profile": profiled, "gc": gc_logged}[mode](out, rest)
