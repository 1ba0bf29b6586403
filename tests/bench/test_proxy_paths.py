"""The proxy bench's paths: a gateway over several replicas of the one backend process."""

from __future__ import annotations

import httpx
import yaml

from bench import _fleet
from bench.gateway._proxy import paths


def test_a_gateway_over_several_backend_ports_has_one_endpoint_each_and_answers() -> None:
    with _fleet.Processes() as procs:
        ports = paths.backends(procs, None, 3)  # type: ignore[arg-type]
        assert len(set(ports)) == 3
        for port in ports:  # each port answers on its own
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        port, _ = paths.gateway(procs, ports, None)  # type: ignore[arg-type]
        static = next(procs.dir.glob(f"static-{port}.yaml"))
        endpoints = yaml.safe_load(static.read_text())["models"][0]["endpoints"]
        assert endpoints == [f"http://127.0.0.1:{p}" for p in ports]
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            answers = [client.post("/v1/chat/completions", json=body) for _ in range(6)]
        assert [a.status_code for a in answers] == [200] * 6
