"""A CPU engine starts while most of its NUMA node's memory is in use (issue 27, item 16).

vLLM's CPU backend (0.32) reserves `--gpu-memory-utilization` x the node's memory and refuses
to start when that much is not available ("Available memory on node 0 ... is less than
desired CPU memory utilization") whenever it sizes the KV cache itself, that is when
VLLM_CPU_KVCACHE_SPACE is unset or empty; with an explicit KV space it checks only that the
KV space is free. The launcher used to pass vLLM's 0.9 and to leave an empty
VLLM_CPU_KVCACHE_SPACE empty, so an engine whose environment said no KV space refused to
start on any machine where other processes held memory. It now gives a CPU engine 1 GiB of
KV space unless the environment sets a size, and reserves what the spec asks for
(resources.memory, else the KV space plus 4 GiB) instead of 0.9.

Here a child process holds memory until less than 0.9 of the node is available (vLLM's
default reservation would refuse), while the launcher's own reservation still fits, then
the tiny engine is started through the launcher, as the operator's pods start it, with an
empty VLLM_CPU_KVCACHE_SPACE, and must answer. That the test can fail:
`KUBELLM_TEST_DEFAULT_RESERVATION=1` starts it through the launcher as it was (0.9, the
empty variable left empty), and vLLM refuses to start.

The child's memory is bounded three ways: it stops at the amount asked for, it stops while
the machine still has KEEP_FREE plus what the engine will take available (other processes
share the machine), and it exits when the test closes its stdin or dies. Where the node is
too small to tell the two reservations apart, or the machine cannot be loaded that far
safely, the test is skipped with the figures it measured.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from kubellm.engine import launcher

from tests.fixtures.engines import running_vllm, tiny_spec

pytestmark = pytest.mark.vllm

GIB = 2**30
# Left available on the machine for everyone else, beyond what the engine takes.
KEEP_FREE = 3 * GIB
# About what the tiny engine holds once started (torch, the weights, 1 GiB of KV space).
ENGINE_TAKES = 3 * GIB
# What vLLM's node check must see beyond the launcher's reservation: the engine's own start
# (imports, the API server process) uses memory before the worker checks it.
START_MARGIN = 1.5 * GIB
# How far under 0.9 of the node the available memory is taken, at least (the 0.9 start
# must fail by a margin), and at most (most of the node in use, not all of the machine).
UNDER_DEFAULT = 0.5 * GIB
MAX_UNDER_DEFAULT = 8 * GIB
CHUNK = 64 * 2**20
# The launcher as it was (before issue 27): vLLM's default 0.9 for a CPU engine, whatever
# its spec asks, and a VLLM_CPU_KVCACHE_SPACE present in the environment left as it is, even
# empty (vLLM then sizes the KV cache itself, from the reservation).
OLD_LAUNCHER = """
import dataclasses, os, sys
from kubellm.engine import __main__ as main, launcher
build = launcher.build_command
def build_as_it_was(*args, **kwargs):
    plan = build(*args, **kwargs)
    argv, env = list(plan.argv), dict(plan.env)
    argv[argv.index("--gpu-memory-utilization") + 1] = "0.9"
    if "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return dataclasses.replace(plan, argv=argv, env=env)
launcher.build_command = build_as_it_was
sys.exit(main.main())
"""

# Holds up to argv[1] bytes, touched (resident), in CHUNK steps while the machine keeps more
# than argv[2] bytes available; prints what it holds, then waits for its stdin to close.
OCCUPIER = r"""
import mmap, sys
want, floor, chunk = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0
ones, held = b"\x01" * chunk, []
while len(held) * chunk + chunk <= want and available() - chunk > floor:
    block = mmap.mmap(-1, chunk)
    block.write(ones)
    held.append(block)
print(len(held) * chunk, flush=True)
sys.stdin.read()
"""


def node_memory(node: int = 0) -> tuple[int, int]:
    """(total, available) bytes of NUMA node `node` as vLLM's CPU backend reads them
    (vllm/utils/cpu_resource_utils.py, get_memory_node_info: free + file pages +
    reclaimable slab), else the machine's MemTotal and MemAvailable."""
    path = Path(f"/sys/devices/system/node/node{node}/meminfo")
    if path.exists():
        info = {}
        for line in path.read_text().splitlines():
            parts = line.split()  # "Node 0 MemTotal: 97421888 kB"
            info[parts[2].rstrip(":")] = int(parts[3]) * 1024
        available = (info["MemFree"] + info["Active(file)"] + info["Inactive(file)"]
                     + info["SReclaimable"])  # fmt: skip
        return info["MemTotal"], available
    return machine_memory()


def machine_memory() -> tuple[int, int]:
    """The machine's (MemTotal, MemAvailable) bytes."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"], info["MemAvailable"]


@contextmanager
def occupied(nbytes: int, floor: int) -> Iterator[int]:
    """Memory held by a child process (at most `nbytes`, leaving `floor` available on the
    machine); yields the bytes held; the child is gone when the block ends."""
    if nbytes < CHUNK:
        yield 0
        return
    child = subprocess.Popen(
        [sys.executable, "-c", OCCUPIER, str(nbytes), str(floor), str(CHUNK)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        held = int(child.stdout.readline() or 0)  # the child prints once it holds it all
        yield held
    finally:
        child.kill()
        child.wait(timeout=30)


def test_the_cpu_engine_starts_where_vllms_default_reservation_would_not(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = tiny_spec(tiny_model_dir)  # no gpuMemoryUtilization, no resources.memory
    total, available = node_memory()
    target = launcher.parse_target(spec)
    share = launcher.cpu_memory_share(target.spec, launcher.DEFAULT_CPU_KVCACHE_GIB, total)
    reserved = share * total
    default = math.ceil(0.9 * total)  # what vLLM's own default reserves
    lowest, highest = reserved + START_MARGIN, default - UNDER_DEFAULT
    figures = (f"node {total / GIB:.2f} GiB, {available / GIB:.2f} available; 0.9 reserves "
               f"{default / GIB:.2f}, the launcher {reserved / GIB:.2f} ({share:g})")  # fmt: skip
    if lowest > highest:
        pytest.skip(f"the node is too small to tell the reservations apart: {figures}")
    goal = max(lowest, highest - MAX_UNDER_DEFAULT)  # the node's available memory wanted
    with occupied(max(0, available - int(goal)), KEEP_FREE + ENGINE_TAKES) as held:
        _, left = node_memory()
        under_load = f"{figures}; held {held / GIB:.2f} GiB, {left / GIB:.2f} GiB left"
        if left >= default or left < reserved:
            pytest.skip(f"could not load the machine that far safely: {under_load}")
        print(under_load)  # shown with -s: the measurement behind this run
        old = os.environ.get("KUBELLM_TEST_DEFAULT_RESERVATION") == "1"
        entry = ("-c", OLD_LAUNCHER) if old else ("-m", "kubellm.engine")
        # No KV space said (an empty variable, as a pod templated from an empty value gets).
        with running_vllm(spec, tmp_path, entry, env={"VLLM_CPU_KVCACHE_SPACE": ""}) as url:
            body = {"model": "tiny", "prompt": "The cat", "max_tokens": 4}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"]
