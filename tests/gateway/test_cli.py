"""`kubellm gateway --port PORT --static FILE`, as a real process.

Run as `python -m kubellm.gateway.cli` (the same configure/run that `kubellm gateway`
wires in), so this test does not depend on the other components' subcommands.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import openai
import yaml

from tests.gateway.upstream import wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gateway_command_serves_a_static_file(engines, tmp_path):
    ((engine, server),) = engines(1)
    static = tmp_path / "static.yaml"
    static.write_text(yaml.safe_dump({"models": [{"name": "tiny", "endpoints": [server.url]}]}))
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kubellm.gateway.cli",
            "--port",
            str(port),
            "--static",
            str(static),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.HTTPError:
                assert process.poll() is None, process.stdout.read().decode()
                return False

        wait_until(up, 20, "the gateway to listen")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )
        assert answer.choices[0].message.content.startswith(engine.name)
    finally:
        process.terminate()
        process.wait(10)


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
