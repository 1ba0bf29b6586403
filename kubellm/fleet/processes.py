"""Engine replicas as local processes: start, health-check, restart with backoff, stop.

This is the local realisation of what the operator realises as a Kubernetes
Deployment: N replicas of one engine command line, each on its own loopback
port, ready when `/health` answers 200. A replica that exits is restarted after
an exponential backoff (as the kubelet does for a crash-looping container) and
reported; stopping a replica drains it first (the gateway stops sending to it)
and then ends its whole process group, so vLLM's engine-core children go too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kubellm import metrics
from kubellm.fleet.cores import free_slot

log = logging.getLogger("kubellm.fleet")

BACKOFF_BASE_SECONDS = 1.0
BACKOFF_CAP_SECONDS = 60.0


def restart_delay(restarts: int) -> float:
    """Seconds to wait before restart number `restarts` (1, 2, 4, ... capped at 60)."""
    return min(BACKOFF_BASE_SECONDS * 2 ** max(restarts - 1, 0), BACKOFF_CAP_SECONDS)


# Where `free_port` looks: below the kernel's ephemeral range (outgoing connections take
# their source ports from that range, and so does bind(("", 0))), above the well-known and
# registered low ports.
LOW_PORT = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default


def ephemeral_range(path: str = _EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in Path(path).read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return low, high


def port_candidates(
    ephemeral: tuple[int, int], rng: random.Random, count: int, low: int = LOW_PORT
) -> list[int]:
    """`count` random ports outside `ephemeral`: below it where there is room (at least
    1,000 ports), else above it."""
    start, end = ephemeral
    if start - low >= 1000:
        return [rng.randrange(low, start) for _ in range(count)]
    if 65535 - end >= 1000:
        return [rng.randrange(end + 1, 65536) for _ in range(count)]
    return []


def free_port(tries: int = 100) -> int:
    """A loopback port nobody listens on now, for a server started next.

    Not `bind(0)`: that picks from the ephemeral range, the same range every outgoing
    connection takes its source port from, so between this call and the server's own
    bind any connection on the machine can take the port ("Address already in use", seen
    under load in CI). Ports outside the range are taken only by another explicit bind."""
    rng = random.Random()
    for port in port_candidates(ephemeral_range(), rng, tries):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room outside the range: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_pair(tries: int = 50) -> int:
    """A free port whose next port is free too (KV events: publisher and replay)."""
    for _ in range(tries):
        port = free_port()
        if port >= 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise OSError("no two consecutive free ports found")


@dataclass
class Replica:
    """One engine process of a deployment."""

    deployment: str
    index: int
    port: int
    argv: list[str]
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    state: str = "starting"  # starting | ready | crashed | draining | replace | stopped
    restarts: int = 0
    kv_events_port: int | None = None  # its own KV-event ports (port, port + 1), if any
    slot: int | None = None  # its fleet-wide core slot (kubellm.fleet.cores), if it binds
    env: dict[str, str] = field(default_factory=dict)  # set beside the inherited environment
    last_exit: int | None = None
    next_start: float = 0.0
    drain_deadline: float = 0.0
    started: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"{self.deployment}-{self.index}"


# Builds an engine command line for (replica index, port).
CommandFor = Callable[[int, int], list[str]]
# Builds a replica's extra environment for (its core slot, the slots in use): see cores.py.
EnvFor = Callable[[int, int], dict[str, str]]


class Supervisor:
    """Keeps `desired[deployment]` replicas of each deployment's command running."""

    def __init__(
        self, log_dir: Path, *, stop_grace_seconds: float = 10.0, drain_seconds: float = 30.0
    ) -> None:
        self.log_dir = log_dir
        self.stop_grace_seconds = stop_grace_seconds
        self.drain_seconds = drain_seconds
        self.replicas: dict[str, list[Replica]] = {}
        self.commands: dict[str, CommandFor] = {}
        self.kv_events: set[str] = set()  # deployments whose replicas publish KV events
        self.envs: dict[str, EnvFor] = {}  # deployments whose replicas take a core slot
        self.desired: dict[str, int] = {}
        self.events: list[str] = []
        self.events_total = 0
        self._client = httpx.AsyncClient(timeout=2.0)

    # ------------------------------------------------------------------ desired state

    def set_command(
        self,
        deployment: str,
        command: CommandFor,
        kv_events: bool = False,
        env: EnvFor | None = None,
    ) -> None:
        """A new command line for a deployment (a spec edit): its replicas are replaced.
        With `kv_events`, each replica gets its own pair of KV-event ports (they share one
        host), passed as `--kv-events-port`. With `env`, each replica takes the lowest free
        core slot among all deployments' replicas and starts with `env(slot, slots)` added
        to its environment (slots: the replicas of such deployments desired, at least
        slot + 1)."""
        changed = deployment in self.commands
        self.commands[deployment] = command
        if env is not None:
            self.envs[deployment] = env
        else:
            self.envs.pop(deployment, None)
        if kv_events:
            self.kv_events.add(deployment)
        else:
            self.kv_events.discard(deployment)
        if changed:
            for replica in self.replicas.get(deployment, []):
                replica.state = "replace"

    def set_replicas(self, deployment: str, count: int) -> None:
        self.desired[deployment] = max(count, 0)

    def forget(self, deployment: str) -> None:
        self.desired[deployment] = 0
        self.commands.pop(deployment, None)
        self.kv_events.discard(deployment)
        self.envs.pop(deployment, None)

    def _argv(self, replica: Replica) -> list[str]:
        argv = self.commands[replica.deployment](replica.index, replica.port)
        if replica.deployment not in self.kv_events:
            replica.kv_events_port = None
            return argv
        replica.kv_events_port = free_port_pair()
        return [*argv, "--kv-events-port", str(replica.kv_events_port)]

    def endpoints(self, deployment: str) -> list[Replica]:
        return list(self.replicas.get(deployment, []))

    # ------------------------------------------------------------------ the loop

    async def reconcile(self) -> None:
        """One pass: start missing replicas, stop surplus ones, restart crashed ones."""
        now = time.monotonic()
        for deployment in list(self.desired):
            replicas = self.replicas.setdefault(deployment, [])
            want = self.desired[deployment] if deployment in self.commands else 0
            for replica in [r for r in replicas if r.state == "replace"]:
                await self._stop(replica)
                replicas.remove(replica)
            serving = [r for r in replicas if r.state != "draining"]
            for replica in serving[want:]:  # highest index first, like a ReplicaSet
                replica.state = "draining"
                replica.drain_deadline = now + self.drain_seconds
                self.event(f"{replica.name} draining (scaled to {want})")
            for replica in [r for r in replicas if r.state == "draining"]:
                if now >= replica.drain_deadline or await self._idle(replica):
                    await self._stop(replica)
                    replicas.remove(replica)
                    self.event(f"{replica.name} stopped")
            while len([r for r in replicas if r.state != "draining"]) < want:
                index = max((r.index for r in replicas), default=-1) + 1
                replicas.append(self._new(deployment, index))
            for replica in replicas:
                if replica.state != "draining":
                    await self._tend(replica, now)

    async def _tend(self, replica: Replica, now: float) -> None:
        process = replica.process
        if process is None:
            if now >= replica.next_start:
                await self._start(replica)
            return
        if process.returncode is not None:
            replica.restarts += 1
            replica.last_exit = process.returncode
            replica.process = None
            replica.state = "crashed"
            delay = restart_delay(replica.restarts)
            replica.next_start = now + delay
            self.event(
                f"{replica.name} exited with status {process.returncode}; restart "
                f"{replica.restarts} in {delay:.0f}s (log: {replica.log_path})"
            )
            return
        if replica.state == "starting" and await self._healthy(replica):
            replica.state = "ready"
            self.event(f"{replica.name} ready at {replica.url}")

    async def _idle(self, replica: Replica) -> bool:
        """True when the engine reports nothing running or waiting (drained)."""
        try:
            response = await self._client.get(f"{replica.url}/metrics")
        except httpx.HTTPError:
            return True  # nothing answers: nothing to wait for
        busy = 0.0
        for line in response.text.splitlines():
            if line.startswith((metrics.NUM_REQUESTS_RUNNING, metrics.NUM_REQUESTS_WAITING)):
                busy += float(line.rsplit(" ", 1)[-1])
        return busy == 0

    async def _healthy(self, replica: Replica) -> bool:
        try:
            response = await self._client.get(f"{replica.url}/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _new(self, deployment: str, index: int) -> Replica:
        port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        replica = Replica(
            deployment=deployment,
            index=index,
            port=port,
            argv=[],
            log_path=self.log_dir / f"{deployment}-{index}.log",
        )
        replica.argv = self._argv(replica)
        return replica

    def _environment(self, replica: Replica) -> dict[str, str]:
        """The replica's extra environment; takes its core slot (see `set_command`)."""
        builder = self.envs.get(replica.deployment)
        if builder is None:
            replica.slot = None
            return {}
        taken = [r.slot for rs in self.replicas.values() for r in rs
                 if r is not replica and r.slot is not None]  # fmt: skip
        replica.slot = free_slot(taken)
        slots = sum(self.desired.get(d, 0) for d in self.envs)
        return builder(replica.slot, max(slots, replica.slot + 1))

    async def _start(self, replica: Replica) -> None:
        if replica.restarts:  # a restart gets a fresh port in case the old one lingers
            replica.port = free_port()
            replica.argv = self._argv(replica)
        replica.env = self._environment(replica)
        with replica.log_path.open("ab") as log_file:
            replica.process = await asyncio.create_subprocess_exec(
                *replica.argv,
                env={**os.environ, **replica.env} if replica.env else None,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its own process group: we stop all of it
            )
        replica.state = "starting"
        replica.started = time.monotonic()
        env = "".join(f"; {k}={v}" for k, v in replica.env.items())
        self.event(
            f"{replica.name} starting on port {replica.port} (pid {replica.process.pid}{env}); "
            f"its output goes to {replica.log_path}"
        )

    async def _stop(self, replica: Replica) -> None:
        replica.state = "stopped"
        process = replica.process
        replica.process = None
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self.stop_grace_seconds)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        # Children that outlived their parent (same process group) go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)

    async def stop_all(self) -> None:
        for replicas in self.replicas.values():
            await asyncio.gather(*(self._stop(r) for r in replicas))
        self.replicas.clear()
        await self._client.aclose()

    def event(self, message: str) -> None:
        log.info(message)
        self.events.append(message)
        self.events_total += 1
        del self.events[:-100]  # the last 100; events_total keeps counting

    def events_since(self, seen: int) -> list[str]:
        """Events after the first `seen` ever recorded (those still kept)."""
        new = self.events_total - seen
        return self.events[-new:] if new > 0 else []
