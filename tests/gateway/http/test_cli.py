"""`kubellm gateway --port PORT --static FILE`, as a real process.

Run as `python -m kubellm.gateway.cli` (the same configure/run that `kubellm gateway`
wires in), so this test does not depend on the other components' subcommands.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kubellm.fleet.processes import free_port
from tests.fixtures.polling import wait_until
from tests.fixtures.servers import ServerThread
from tests.gateway.upstream import FakeEngine


def _start_gateway(
    static: Path, env: dict[str, str] | None = None, *flags: str
) -> tuple[subprocess.Popen, int]:
    """`python -m kubellm.gateway.cli --port P --static FILE [flags]`, listening when
    returned."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kubellm.gateway.cli",
            "--port",
            str(port),
            "--static",
            str(static),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            if process.poll() is not None:
                raise AssertionError(process.stdout.read().decode()) from None
            return False

    try:
        wait_until(up, 20, "the gateway to listen")
    except BaseException:
        process.terminate()
        process.wait(10)
        raise
    return process, port


def test_gateway_command_serves_a_static_file(engines, tmp_path):
    ((engine, server),) = engines(1)
    static = tmp_path / "static.yaml"
    static.write_text(yaml.safe_dump({"models": [{"name": "tiny", "endpoints": [server.url]}]}))
    process, port = _start_gateway(static)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )
        assert answer.choices[0].message.content.startswith(engine.name)
    finally:
        process.terminate()
        process.wait(10)


def _self_signed(directory: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by its own key: (certificate file, key file)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubellm test engine")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "engine.crt", directory / "engine.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


def test_an_https_replica_is_verified_against_ssl_cert_file(tmp_path):
    """An https endpoint goes through the TLS client: trusted via SSL_CERT_FILE, refused
    (502, nothing relayed) while its certificate is not trusted."""
    tls = _self_signed(tmp_path)
    engine = FakeEngine("tls")
    server = ServerThread(engine.app(), tls=tls).start()
    static = tmp_path / "static.yaml"
    static.write_text(yaml.safe_dump({"models": [{"name": "tiny", "endpoints": [server.url]}]}))
    assert server.url.startswith("https://")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    try:
        untrusted = {k: v for k, v in os.environ.items() if k != "SSL_CERT_FILE"}
        for env, trusted in ((untrusted, False), ({**untrusted, "SSL_CERT_FILE": tls[0]}, True)):
            process, port = _start_gateway(static, env)
            try:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                with httpx.stream("POST", url, json=body, timeout=20) as response:
                    text = response.read().decode()
                if trusted:
                    assert response.status_code == 200, text
                    assert response.headers["x-kubellm-route"] == "replica"
                    assert "tls-t0" in text and text.rstrip().endswith("data: [DONE]")
                else:
                    assert response.status_code == 502, text
                    assert "tls-t0" not in text
            finally:
                process.terminate()
                process.wait(10)
        assert engine.completed == 1  # the untrusted attempt never reached the engine
    finally:
        server.stop()


def test_bad_static_file_exits_with_the_field_named(tmp_path):
    static = tmp_path / "static.yaml"
    static.write_text("models: [{name: a, routing: {loadBound: 0.5}}]")
    result = subprocess.run(
        [sys.executable, "-m", "kubellm.gateway.cli", "--static", str(static)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "models[0].routing.loadBound" in result.stderr


@pytest.mark.parametrize("keys", ["--api-keys-file", "--tenants"])
def test_metrics_are_not_served_unauthenticated_where_the_api_asks_a_key(engines, tmp_path, keys):
    """With API keys (or tenants) and no --metrics-port (the default), /metrics was served
    on the API port with no key while /v1/* asked for one: any client read every tenant's
    usage. Now the API port refuses it (403, saying where it is) and --metrics-port serves
    it."""
    ((_engine, server),) = engines(1)
    static = tmp_path / "static.yaml"
    static.write_text(yaml.safe_dump({"models": [{"name": "tiny", "endpoints": [server.url]}]}))
    digest = hashlib.sha256(b"sk-team").hexdigest()
    if keys == "--tenants":
        file = tmp_path / "tenants.yaml"
        file.write_text(
            yaml.safe_dump({"tenants": [{"name": "team", "apiKeys": [f"sha256:{digest}"]}]})
        )
    else:
        file = tmp_path / "keys"
        file.write_text(digest + "\n")
    process, port = _start_gateway(static, None, keys, str(file))
    try:
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/v1/models").status_code == 401
        team = {"authorization": "Bearer sk-team"}
        assert httpx.get(f"{base}/v1/models", headers=team).status_code == 200
        for headers in ({}, team):  # not for a tenant's key either: it shows every tenant
            refused = httpx.get(f"{base}/metrics", headers=headers)
            assert refused.status_code == 403, refused.text
            assert "--metrics-port" in refused.json()["error"]["message"]
    finally:
        process.terminate()
        process.wait(10)
    metrics_port = free_port()
    process, port = _start_gateway(
        static, None, keys, str(file), "--metrics-port", str(metrics_port)
    )
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert "kubellm_gateway_requests_total" in text or "kubellm_gateway" in text
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 404
    finally:
        process.terminate()
        process.wait(10)
