"""A replica that hangs on its adapter-load API holds only its own load slots: another
model's adapters still load, and a request waiting on the hung load gives up within its
deadline with a message that says the load is pending."""

from __future__ import annotations

import json
import threading

import httpx

from tests.fixtures.engines import wait_until
from tests.gateway.faults.peers import Request, completion, response


def models_answer(request: Request, base: str, loaded: set[str]) -> bytes:
    cards = [{"id": base, "object": "model"}]
    cards += [{"id": n, "object": "model", "parent": base} for n in sorted(loaded)]
    return response(json.dumps({"object": "list", "data": cards}).encode())


def ask(url: str, model: str, timeout: float = 30) -> httpx.Response:
    body = {"model": model, "prompt": "p", "max_tokens": 4}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def test_a_hung_adapter_load_blocks_only_its_own_replica(raw_engine, gateway_process):
    hung_loads: list[Request] = []

    def hangs(request: Request) -> bytes | None:
        if request.path == "/v1/load_lora_adapter":
            hung_loads.append(request)
            return None  # never answers: a frozen load
        if request.path == "/v1/models":
            return models_answer(request, "a", set())
        return completion("from a")

    loaded: set[str] = set()

    def loads(request: Request) -> bytes:
        if request.path == "/v1/load_lora_adapter":
            loaded.add(request.json()["lora_name"])
            return response(b"Success")
        if request.path == "/v1/models":
            return models_answer(request, "b", loaded)
        return completion("from b")

    a, b = raw_engine(hangs), raw_engine(loads)
    slo = {"ttftSeconds": 3}
    gw = gateway_process(
        [
            {"name": "a", "endpoints": [a.url], "adapters": {"a1": "/x/a1", "a2": "/x/a2"},
             "slo": slo},
            {"name": "b", "endpoints": [b.url], "adapters": {"b1": "/x/b1"}, "slo": slo},
        ],
        "--max-adapter-loads", "2",
    )  # fmt: skip
    answers: dict[str, httpx.Response] = {}

    def ask_into(model: str) -> None:
        answers[model] = ask(gw.url, model)

    # Two requests for two adapters of model a: both load slots of a's replica hang.
    threads = [threading.Thread(target=ask_into, args=(n,)) for n in ("a1", "a2")]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(hung_loads) == 2, 20, "both loads to reach the hung replica")
    # Model b's adapter loads on its own replica meanwhile, and its request is answered.
    answer = ask(gw.url, "b1")
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == "from b"
    assert loaded == {"b1"}
    for thread in threads:
        thread.join(30)
    for name in ("a1", "a2"):
        refused = answers[name]
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert f"Adapter `{name}`" in message and "being loaded" in message, message
        assert "Retry-After" in refused.headers
