"""The Kubernetes API client configuration, shared by every component that talks to the
API server: the gateway's discovery, the autoscaler's backend, and the operator (kopf logs
in with it; the reconciler's own calls go through an httpx client from it).

The configuration is loaded by the official client's loaders (`kubernetes_asyncio.config`):
the pod's service account in a cluster, else a kubeconfig (KUBECONFIG, a list of files
merged as kubectl merges them, or ~/.kube/config) with everything kubectl's users carry:
tokens, token files, client certificates, basic auth, and exec credential plugins (EKS, GKE,
AKS). The calls themselves go through httpx (`async_client`), whose `Authorization` comes
from the loader on every request: an exec plugin runs again when its credential expires
(and once on a 401), and the in-cluster token file is read again each minute (projected
tokens rotate), as client-go does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import ssl
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kubellm import api

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# The longest an exec credential plugin may take (`aws eks get-token` takes about a second;
# one waiting on a browser login is not for a controller).
EXEC_TIMEOUT_SECONDS = 60.0


class KubeConfigError(ValueError):
    """No usable configuration: the message names the file or what is missing."""


class Credentials:
    """The current `Authorization` value, as the official client's loader keeps it.

    `current()` before each request: the loader refreshes what has expired (an exec
    plugin's credential past its expirationTimestamp, the in-cluster token after a minute);
    `renew()` after a 401: an exec plugin runs again at once.
    """

    def __init__(
        self,
        read: Callable[[], str | None],
        refresh: Callable[[], Awaitable[Any]] | None = None,
        renew: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self._read, self._refresh, self._renew = read, refresh, renew

    async def current(self) -> str | None:
        if self._refresh is not None:
            async with asyncio.timeout(EXEC_TIMEOUT_SECONDS):
                await self._refresh()
        return self._read()

    async def renew(self) -> bool:
        """Fetch a new credential; False when there is no way to (a static token)."""
        if self._renew is None:
            return False
        async with asyncio.timeout(EXEC_TIMEOUT_SECONDS):
            await self._renew()
        return True


@dataclass(frozen=True)
class KubeConfig:
    server: str
    token: str | None = None  # the bearer token when loaded (kopf's login takes it)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False
    namespace: str = "default"
    # where `async_client` asks for the Authorization of each request (None: `token`)
    credentials: Credentials | None = field(default=None, compare=False, repr=False)


def _bearer(authorization: str | None) -> str | None:
    if authorization and authorization.startswith("Bearer "):
        return authorization.removeprefix("Bearer ")
    return None


def _run(coroutine: Coroutine[Any, Any, KubeConfig]) -> KubeConfig:
    """Run a loader from synchronous code, inside a running event loop or not."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def in_cluster(directory: Path | None = None) -> KubeConfig:
    """The pod's service account (`directory`: where its token, CA and namespace are)."""
    from kubernetes_asyncio.client import Configuration
    from kubernetes_asyncio.config import ConfigException, incluster_config

    directory = directory or SERVICE_ACCOUNT_DIR
    configuration = Configuration()
    try:
        incluster_config.InClusterConfigLoader(
            token_filename=str(directory / "token"),
            cert_filename=str(directory / "ca.crt"),
            try_refresh_token=True,
        ).load_and_set(configuration)
    except (ConfigException, OSError) as error:
        raise KubeConfigError(f"in-cluster configuration ({directory}): {error}") from None
    hook = configuration.refresh_api_key_hook

    async def refresh() -> None:
        hook(configuration)  # reads the token file again once a minute has passed

    def read() -> str | None:
        return configuration.api_key.get("BearerToken")

    namespace_file = directory / "namespace"
    return KubeConfig(
        server=configuration.host,
        token=_bearer(read()),
        ca_file=configuration.ssl_ca_cert,
        namespace=namespace_file.read_text().strip() if namespace_file.exists() else "default",
        credentials=Credentials(read, refresh),
    )


async def from_kubeconfig_async(path: str | None = None, context: str | None = None) -> KubeConfig:
    """A kubeconfig (`path`, else KUBECONFIG, else ~/.kube/config), loaded by the official
    client's loader; an exec plugin runs now and again when its credential expires."""
    from kubernetes_asyncio.client import Configuration
    from kubernetes_asyncio.config import ConfigException, kube_config

    path = path or os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    configuration = Configuration()
    try:
        async with asyncio.timeout(EXEC_TIMEOUT_SECONDS):
            loader = await kube_config.load_kube_config(
                path, context, configuration, persist_config=False
            )
    except (ConfigException, OSError, ValueError, KeyError, TypeError, AssertionError) as error:
        raise KubeConfigError(f"kubeconfig {path}: {error or type(error).__name__}") from None
    except TimeoutError:
        raise KubeConfigError(
            f"kubeconfig {path}: the exec credential plugin did not answer in "
            f"{EXEC_TIMEOUT_SECONDS:g} s"
        ) from None
    user = loader._user  # the context's user, as the library chose it
    exec_user = user is not None and "exec" in user

    def read() -> str | None:
        return getattr(loader, "token", None)

    async def refresh() -> None:  # the library runs the plugin again once it has expired
        if getattr(loader, "exec_plugin_expiry", None) is not None:
            await loader.load_from_exec_plugin()

    async def renew() -> None:
        loader.__dict__.pop("exec_plugin_expiry", None)
        await loader.load_from_exec_plugin()

    context_ = (loader.current_context or {}).get("context") or {}
    return KubeConfig(
        server=configuration.host.rstrip("/"),
        token=_bearer(read()),
        ca_file=configuration.ssl_ca_cert,
        cert_file=configuration.cert_file,
        key_file=configuration.key_file,
        insecure=not configuration.verify_ssl,
        namespace=context_.get("namespace") or "default",
        credentials=Credentials(read, refresh if exec_user else None, renew if exec_user else None),
    )


def from_kubeconfig(path: str | None = None, context: str | None = None) -> KubeConfig:
    """`from_kubeconfig_async` from synchronous code."""
    return _run(from_kubeconfig_async(path, context))


def load() -> KubeConfig:
    """In-cluster configuration inside a pod, the kubeconfig elsewhere."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster()
    return from_kubeconfig()


class _Auth(httpx.Auth):
    """Each request's Authorization from the credentials; after a 401, renewed once."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        value = await self.credentials.current()
        if value:
            request.headers["Authorization"] = value
        response = yield request
        if response.status_code == 401 and await self.credentials.renew():
            value = await self.credentials.current()
            if value:
                request.headers["Authorization"] = value
            yield request


def async_client(config: KubeConfig, timeout: float = 30.0) -> httpx.AsyncClient:
    verify: ssl.SSLContext | bool = not config.insecure
    if config.server.startswith("https") and not config.insecure:
        verify = ssl.create_default_context(cafile=config.ca_file)
        if config.cert_file and config.key_file:
            verify.load_cert_chain(config.cert_file, config.key_file)
    if config.credentials is not None:
        return httpx.AsyncClient(
            base_url=config.server, auth=_Auth(config.credentials), verify=verify, timeout=timeout
        )
    headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
    return httpx.AsyncClient(
        base_url=config.server, headers=headers, verify=verify, timeout=timeout
    )


def llmd_path(namespace: str | None = None, name: str | None = None, sub: str = "") -> str:
    """API path of LLMDeployments: the collection, one object, or a subresource of it."""
    base = f"/apis/{api.GROUP}/{api.VERSION}"
    path = f"{base}/namespaces/{namespace}/{api.PLURAL}" if namespace else f"{base}/{api.PLURAL}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path
