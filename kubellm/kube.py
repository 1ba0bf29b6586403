"""A minimal Kubernetes API client configuration, shared by every component that talks
to the API server: the gateway's discovery, the autoscaler's backend, and the operator
(kopf logs in with it; the reconciler's own calls go through an httpx client from it).

Configuration comes from the pod's service account when running in a cluster,
otherwise from a kubeconfig file (KUBECONFIG or ~/.kube/config), token or
client-certificate auth.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kubellm import api

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class KubeConfig:
    server: str
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False
    namespace: str = "default"


def in_cluster() -> KubeConfig:
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    namespace_file = SERVICE_ACCOUNT_DIR / "namespace"
    return KubeConfig(
        server=f"https://{host}:{port}",
        token=(SERVICE_ACCOUNT_DIR / "token").read_text().strip(),
        ca_file=str(SERVICE_ACCOUNT_DIR / "ca.crt"),
        namespace=namespace_file.read_text().strip() if namespace_file.exists() else "default",
    )


def _materialise(data: str | None, suffix: str) -> str | None:
    if not data:
        return None
    handle = tempfile.NamedTemporaryFile(delete=False, suffix=suffix)  # noqa: SIM115
    handle.write(base64.b64decode(data))
    handle.close()
    return handle.name


def from_kubeconfig(path: str | None = None, context: str | None = None) -> KubeConfig:
    path = path or os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config"))
    config: dict[str, Any] = yaml.safe_load(Path(path).read_text())
    name = context or config.get("current-context")
    ctx = next(c["context"] for c in config["contexts"] if c["name"] == name)
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == ctx["cluster"])
    user = next((u["user"] for u in config.get("users", []) if u["name"] == ctx.get("user")), {})
    return KubeConfig(
        server=cluster["server"].rstrip("/"),
        token=user.get("token"),
        ca_file=cluster.get("certificate-authority")
        or _materialise(cluster.get("certificate-authority-data"), ".crt"),
        cert_file=user.get("client-certificate")
        or _materialise(user.get("client-certificate-data"), ".crt"),
        key_file=user.get("client-key") or _materialise(user.get("client-key-data"), ".key"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        namespace=ctx.get("namespace", "default"),
    )


def load() -> KubeConfig:
    """In-cluster configuration inside a pod, the kubeconfig elsewhere."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster()
    return from_kubeconfig()


def async_client(config: KubeConfig, timeout: float = 30.0) -> httpx.AsyncClient:
    verify: ssl.SSLContext | bool = not config.insecure
    if config.server.startswith("https") and not config.insecure:
        verify = ssl.create_default_context(cafile=config.ca_file)
        if config.cert_file and config.key_file:
            verify.load_cert_chain(config.cert_file, config.key_file)
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
