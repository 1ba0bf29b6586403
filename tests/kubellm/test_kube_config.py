"""`kubellm.kube`: the API client's configuration as the official client's loaders read it,
used against a loopback API server that checks the bearer token: a kubeconfig whose user is
an exec credential plugin (a script on disk printing an ExecCredential), and the in-cluster
service account whose token file changes under a running client."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import ssl
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kubellm import kube

PLUGIN = """
import json, pathlib, sys
counter = pathlib.Path(sys.argv[1])
runs = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(runs))
status = {"token": f"token-{runs}"}
if sys.argv[2]:
    status["expirationTimestamp"] = sys.argv[2]
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": status}))
"""


@asynccontextmanager
async def api_server(
    accepted: Callable[[str], bool], ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[str, list[str]]]:
    """A loopback API server answering /version when the bearer token is `accepted`, 401
    otherwise; yields its URL and the Authorization values it saw."""
    seen: list[str] = []

    async def version(request: web.Request) -> web.Response:
        value = request.headers.get("Authorization", "")
        seen.append(value)
        if not value.startswith("Bearer ") or not accepted(value.removeprefix("Bearer ")):
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        return web.json_response({"major": "1", "minor": "33"})

    app = web.Application()
    app.router.add_get("/version", version)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


def write_kubeconfig(tmp_path: Path, server: str, expiry: str) -> Path:
    script = tmp_path / "plugin.py"
    script.write_text(PLUGIN)
    exec_ = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": sys.executable,
        "args": [str(script), str(tmp_path / "runs"), expiry],
        "interactiveMode": "Never",
    }
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", "namespace": "ns"}}],
        "users": [{"name": "u", "user": {"exec": exec_}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def _stamp(delta: dt.timedelta) -> str:
    return (dt.datetime.now(dt.UTC) + delta).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _versions(config: kube.KubeConfig, count: int) -> list[int]:
    async with kube.async_client(config, timeout=30.0) as client:
        return [(await client.get("/version")).status_code for _ in range(count)]


def test_an_exec_plugin_credential_is_used_and_kept_until_it_expires(tmp_path: Path) -> None:
    async def main() -> tuple[kube.KubeConfig, list[int], list[str]]:
        async with api_server(lambda token: token == "token-1") as (url, seen):
            path = write_kubeconfig(tmp_path, url, _stamp(dt.timedelta(hours=1)))
            config = await kube.from_kubeconfig_async(str(path))
            return config, await _versions(config, 3), seen

    config, codes, seen = asyncio.run(main())
    assert (config.token, config.namespace) == ("token-1", "ns")
    assert codes == [200, 200, 200] and seen == ["Bearer token-1"] * 3
    assert (tmp_path / "runs").read_text() == "1"  # one run while the credential is valid


def test_an_expired_exec_credential_is_fetched_again(tmp_path: Path) -> None:
    async def main() -> tuple[list[int], list[str]]:
        async with api_server(lambda token: token.startswith("token-")) as (url, seen):
            path = write_kubeconfig(tmp_path, url, _stamp(dt.timedelta(seconds=-60)))
            config = await kube.from_kubeconfig_async(str(path))
            return await _versions(config, 2), seen

    codes, seen = asyncio.run(main())
    assert codes == [200, 200]
    assert seen == ["Bearer token-2", "Bearer token-3"]  # loading ran it once, then each call


def test_a_refused_exec_credential_is_renewed_once(tmp_path: Path) -> None:
    async def main() -> tuple[list[int], list[str]]:
        async with api_server(lambda token: token == "token-2") as (url, seen):
            path = write_kubeconfig(tmp_path, url, "")  # no expiry: kept until a 401
            config = kube.from_kubeconfig(str(path))  # the synchronous form, inside a loop
            return await _versions(config, 2), seen

    codes, seen = asyncio.run(main())
    assert codes == [200, 200]
    assert seen == ["Bearer token-1", "Bearer token-2", "Bearer token-2"]


def test_a_bad_kubeconfig_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\ncontexts: []\n")
    with pytest.raises(kube.KubeConfigError, match=str(path)):
        kube.from_kubeconfig(str(path))


def _self_signed(directory: Path) -> ssl.SSLContext:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubellm test API server")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (directory / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(directory / "ca.crt", directory / "tls.key")
    return context


def test_a_rotated_in_cluster_token_is_used_by_a_running_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kubernetes_asyncio.config import incluster_config

    # the library reads the token file again once this has passed (a minute by default,
    # as client-go): shortened so the rotation shows without waiting a minute
    monkeypatch.setattr(incluster_config, "TOKEN_REFRESH_PERIOD", dt.timedelta(0))
    account = tmp_path / "serviceaccount"
    account.mkdir()
    server_tls = _self_signed(account)
    (account / "token").write_text("old-token")
    (account / "namespace").write_text("team-a")
    valid = {"old-token"}

    async def main() -> tuple[kube.KubeConfig, list[int], list[str]]:
        async with api_server(lambda token: token in valid, server_tls) as (url, seen):
            monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
            monkeypatch.setenv("KUBERNETES_SERVICE_PORT", url.rsplit(":", 1)[1])
            config = kube.in_cluster(account)
            codes = []
            async with kube.async_client(config, timeout=30.0) as client:
                codes.append((await client.get("/version")).status_code)
                (account / "token").write_text("new-token")  # the kubelet rotates it
                valid.clear()
                valid.add("new-token")
                codes.append((await client.get("/version")).status_code)
            return config, codes, seen

    config, codes, seen = asyncio.run(main())
    assert config.namespace == "team-a" and config.server.startswith("https://127.0.0.1:")
    assert codes == [200, 200]
    assert seen == ["Bearer old-token", "Bearer new-token"]


def test_a_missing_service_account_is_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(kube.KubeConfigError, match=str(tmp_path)):
        kube.in_cluster(tmp_path)
