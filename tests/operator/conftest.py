"""The operator against kmock's Kubernetes API emulator, with kopf running in-process.

The emulator stores objects and streams watch events but is not an API server:
it does not default, validate, garbage-collect or run controllers. Two gaps are
filled here, each the behaviour of a real API server:
- server-side apply (PATCH application/apply-patch+yaml) creates a missing object;
- `metadata.uid` and `metadata.generation` are set by the test when it writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import jsonpatch
import kmock
import kopf
import pytest
import yaml
from kubellm.operator import handlers

from kubellm import api, kube
from tests.fixtures import rbac
from tests.fixtures.polling import eventually

ROOT = Path(__file__).resolve().parents[2]
RBAC_FILE = ROOT / "operator" / "rbac-requests.yaml"
TEST_AGENT = "kubellm-tests"
LLMD = f"{api.GROUP}/{api.VERSION}/{api.PLURAL}"


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus three API-server behaviours clients rely on.

    - `metadata.resourceVersion` changes on every write (kopf tests it in JSON patches);
    - `metadata.generation` increases when `spec` changes (the scale subresource too);
    - server-side apply (PATCH application/apply-patch+yaml) creates a missing object.
    """

    versions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)

    def _stamp(self, request: Any) -> None:
        version = str(next(self.versions))
        data = request.data
        if request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = version
            if "generateName" in meta and "name" not in meta:
                meta["name"] = f"{meta['generateName']}{version}"
            data["metadata"].setdefault("generation", 1)
        elif request.action == kmock.action.UPDATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = version
            key = (request.resource, request.namespace, request.name)
            live = self.objects[key] if key in self.objects else None  # noqa: SIM401 (no .get)
            if "spec" in data and request.subresource != "status" and live and not live.deleted:
                meta["generation"] = int(live.get("metadata", {}).get("generation") or 1) + 1
        elif request.action == kmock.action.UPDATE and isinstance(data, list):
            data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})

    async def _render_error(self, exc: Exception) -> Any:
        if isinstance(exc, jsonpatch.JsonPatchTestFailed):  # a stale resourceVersion
            exc = kmock.KubernetesError(status=422, reason="Invalid", message=str(exc))
        return await super()._render_error(exc)

    async def _handle(self, request: Any) -> Any:
        content_type = request.headers.get("Content-Type", "")
        if (
            request.action == kmock.action.UPDATE
            and content_type.startswith("application/apply-patch")
            and request.name is not None
            and not request.subresource
        ):
            key = (request.resource, request.namespace, request.name)
            async with self._lock:
                if key not in self.objects or self.objects[key].deleted:
                    body = {
                        **request.data,
                        "metadata": {
                            **request.data["metadata"],
                            "resourceVersion": str(next(self.versions)),
                            "generation": 1,
                        },
                    }
                    if key in self.objects:
                        self.objects[key].create(body)
                    else:
                        self.objects[key] = body
                    raw = self.objects[key].last.raw
                    await self._buses[request.resource].put({"type": "ADDED", "object": raw})
        self._stamp(request)
        return await super()._handle(request)


async def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    """`eventually`, where an object the emulator does not hold yet counts as not yet."""
    lookups = (KeyError, AttributeError, TypeError, IndexError)
    return await eventually(predicate, timeout, what, interval=0.02, ignore=lookups)


def rbac_rules() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples from operator/rbac-requests.yaml."""
    return rbac.rules(RBAC_FILE)


def _method(request: Any) -> str:
    return str(getattr(request.method, "value", request.method)).upper()


def recorded_requests(emulator: Emulator) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) for every resource request made so far."""
    return rbac.recorded(emulator, skip_agent=TEST_AGENT)


WRITE_METHODS = {"POST", "PATCH", "PUT", "DELETE"}


def writes_since(emulator: Emulator, start: int) -> list[str]:
    return [
        f"{r.method} {r.url.path}"
        for r in list(emulator)[start:]
        if _method(r) in WRITE_METHODS and r.resource is not None
    ]


async def writes_over_resyncs(emulator: Emulator, llmd_path: str, passes: int = 3) -> list[str]:
    """The writes made while the resync timer runs `passes` more reconciles (each reads the
    LLMDeployment at `llmd_path` fresh): none, for an unchanged object."""
    mark = len(list(emulator))
    reads = f"GET {llmd_path}"
    await wait_for(
        lambda: (
            [f"{_method(r)} {r.url.path}" for r in list(emulator)[mark:]].count(reads) >= passes
        ),
        what=f"{passes} resync passes",
    )
    return writes_since(emulator, mark)


@pytest.fixture
async def emulator() -> AsyncIterator[Emulator]:
    async with Emulator() as emu, kmock.Server(emu):
        emu.resources.load_bundled()
        emu.resources[LLMD] = kmock.ResourceInfo(
            kind=api.KIND,
            singular=api.SINGULAR,
            namespaced=True,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            shortnames=set(api.SHORT_NAMES),
            subresources={"status", "scale"},
        )
        yield emu
        # Every request the operator made must be granted by the recorded RBAC list.
        missing = recorded_requests(emu) - rbac_rules()
        assert not missing, f"requests missing from {RBAC_FILE.name}: {sorted(missing)}"


@pytest.fixture
async def api_client(emulator: Emulator) -> AsyncIterator[httpx.AsyncClient]:
    """What a person (kubectl) or another controller does to the API, in tests."""
    headers = {"User-Agent": TEST_AGENT}
    async with httpx.AsyncClient(base_url=str(emulator.url), headers=headers) as client:
        yield client


@contextlib.asynccontextmanager
async def running_operator(
    emulator: Emulator,
    resync_seconds: float = 60.0,
    retry_seconds: float = 0.05,
    figures: Any = None,
    rollout_seconds: float = 5.0,
    picker: Any = None,
) -> AsyncIterator[None]:
    """kopf's real operator, in its own thread and event loop.

    kopf cancels, when it exits, every task of its loop that it did not find at
    start; its own loop keeps the test's tasks (and the emulator) out of reach.
    """
    registry = kopf.OperatorRegistry()
    config = kube.KubeConfig(server=str(emulator.url).rstrip("/"))
    handlers.register(
        registry,
        connect=lambda: config,
        resync_seconds=resync_seconds,
        retry_seconds=retry_seconds,
        rollout_seconds=rollout_seconds,
        figures=lambda: figures,
        **({"picker": picker} if picker is not None else {}),
    )
    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0.1
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=registry,
                    settings=settings,
                    standalone=True,
                    clusterwide=True,
                    stop_flag=stop,
                )
            )
        except BaseException as error:  # reported by the test below
            errors.append(error)

    thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 15)
        assert not thread.is_alive(), "the operator did not stop within 15 s"
        assert not errors, f"the operator failed: {errors!r}"


@pytest.fixture
async def operator(emulator: Emulator) -> AsyncIterator[None]:
    async with running_operator(emulator):
        yield


def manifest(path: Path, uid: str = "uid-1", generation: int = 1) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text())
    document["metadata"].setdefault("namespace", "default")
    document["metadata"]["uid"] = uid
    document["metadata"]["generation"] = generation
    return document


async def create(client: httpx.AsyncClient, document: dict[str, Any]) -> None:
    ns = document["metadata"]["namespace"]
    response = await client.post(
        f"/apis/{api.API_VERSION}/namespaces/{ns}/{api.PLURAL}", content=json.dumps(document)
    )
    response.raise_for_status()


async def patch(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
    response = await client.patch(
        path, content=json.dumps(body), headers={"Content-Type": "application/merge-patch+json"}
    )
    response.raise_for_status()
