"""What the benchmarks share to start their processes: a free loopback port, a wait for
`/health` (or any URL) with a deadline that notices a process that died, a core pin, and
the simulated replicas and gateways the routing benchmarks put in front of them
(gateway_routing.py, lora_routing.py, gateway_real_engines.py).

The benchmarks import this as `bench._fleet` (they run as `python -m bench.x`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from kubellm.fleet.processes import free_port

__all__ = ["Processes", "free_port", "pinned", "responds", "wait_healthy"]

# Loopback only: no proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def responds(url: str, timeout: float = 1.0) -> bool:
    """`url` answers 200."""
    try:
        with _OPENER.open(url, timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def wait_healthy(
    url: str,
    process: subprocess.Popen[bytes] | None = None,
    timeout: float = 30.0,
    path: str = "/health",
) -> None:
    """Until `url` + `path` answers 200; RuntimeError (with the tail of the process's log,
    when it has one) if `process` exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not responds(url + path):
        if process is not None and process.poll() is not None:
            log = getattr(process, "log_path", None)
            tail = Path(log).read_text(errors="replace")[-2000:] if log else ""
            raise RuntimeError(f"{url}: the process exited with {process.returncode}\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}{path} did not answer 200 within {timeout:g} s")
        time.sleep(0.05)


def pinned(core: int | None) -> Callable[[], None] | None:
    """A `preexec_fn` that pins the child to `core` (None: no pin)."""
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})


class Processes:
    """Processes started for one run, each logging to its own file in a temporary folder;
    all stopped (SIGTERM, then SIGKILL after 10 s) by `stop` or on leaving a `with`."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        self.stoppers: list[Callable[[], None]] = []
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)

    def spawn(
        self, command: Sequence[str], core: int | None = None, **kw: object
    ) -> subprocess.Popen[bytes]:
        log = open(self.dir / f"p{len(self.processes)}.log", "wb")  # noqa: SIM115
        process = subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT, preexec_fn=pinned(core), **kw
        )
        process.log_path = log.name  # type: ignore[attr-defined]
        self.processes.append(process)
        return process

    def sim(self, *args: str, core: int | None = None) -> str:
        """A simulated replica (`kubellm.engine --backend sim ARGS`); its URL once healthy."""
        port = free_port()
        command = [sys.executable, "-m", "kubellm.engine", "--backend", "sim",
                   "--port", str(port), *args]  # fmt: skip
        process = self.spawn(command, core)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        return url

    def gateway(self, static: Path, *flags: str, python: str = sys.executable) -> str:
        """A `kubellm gateway --static` process; its URL once healthy."""
        port = free_port()
        process = self.spawn([python, "-m", "kubellm.gateway.cli", "--port", str(port),
                              "--static", str(static), *flags])  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        return url

    def stop(self) -> None:
        for stop in self.stoppers:
            stop()
        self.stoppers.clear()
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        self.processes.clear()
        self.tmp.cleanup()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
