"""`--instructions`: the gateway's machine instructions per request, a figure noise cannot move.

On a shared machine the socket rows' CPU per request moves by 20% between two runs of the
same code (measured: this checkout against itself, 0.318 vs 0.386 ms). Instructions do
not: the gateway server process (`python -m kubellm.gateway.cli --static`, as deployed)
runs under valgrind's callgrind with counting off; after a warm-up the counting is
switched on (`callgrind_control -i on`) for `--requests` requests on one keep-alive
connection, then off, and the total is divided by the count. Repeatable to about 1%
whatever else the machine runs. Work that runs on a timer (scrapes, the static file's
reload check) costs per second, not per request, and valgrind stretches a request about
50x: so the same process is then counted idle for a few seconds, and that rate times the
loaded run's length is taken off (without it a stream, long under valgrind, was charged
for seconds of scrapes).

Needs valgrind (`apt-get install valgrind`).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .paths import BACKEND, _fleet

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}
STREAM = {"bench_chunks": 16, "bench_itl_ms": 25.0}
WARM_UP = 100
IDLE_SECONDS = 5.0


def per_request(python: str, requests: int, stream: bool, flags: tuple[str, ...] = ()) -> float:
    """Instructions per request of the gateway run by `python` (its checkout's kubellm),
    started with `flags`."""
    work = Path(tempfile.mkdtemp(prefix="kubellm-instr-"))
    backend_port, port = _fleet.free_port(), _fleet.free_port()
    (work / "static.yaml").write_text(
        f"models:\n- name: m\n  endpoints: ['http://127.0.0.1:{backend_port}']\n"
    )
    out = work / "callgrind.out"
    backend = subprocess.Popen([sys.executable, str(BACKEND), str(backend_port)])
    gateway = subprocess.Popen(
        [
            "valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            python, "-m", "kubellm.gateway.cli", "--port", str(port),
            "--static", str(work / "static.yaml"), *flags,
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _fleet.wait_healthy(f"http://127.0.0.1:{backend_port}", backend, timeout=60)
        _fleet.wait_healthy(f"http://127.0.0.1:{port}", gateway, timeout=600)
        # streams paced as the socket bench's stream phase: 16 events 25 ms apart, so each
        # network piece is one event (as from an engine), not a burst of them
        body = {**BODY, "stream": True, **STREAM} if stream else BODY
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            for _ in range(WARM_UP // 5 if stream else WARM_UP):
                client.post("/v1/chat/completions", json=body).raise_for_status()
            _control(gateway.pid, "-i", "on")
            began = time.monotonic()
            for _ in range(requests):
                client.post("/v1/chat/completions", json=body).raise_for_status()
            loaded = time.monotonic() - began
            _control(gateway.pid, "--dump=loaded")
            began = time.monotonic()  # the same process idle: what its timers cost a second
            time.sleep(IDLE_SECONDS)
            _control(gateway.pid, "--dump=idle")
            idle = time.monotonic() - began
            _control(gateway.pid, "-i", "off")
    finally:
        gateway.send_signal(signal.SIGINT)
        try:
            gateway.wait(120)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait(10)
        backend.send_signal(signal.SIGINT)
        backend.wait(10)
    parts = sorted(work.glob("callgrind.out.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
    if len(parts) < 2:
        raise RuntimeError(f"callgrind wrote {len(parts)} dumps, not 2")
    busy, quiet = _total(parts[0]), _total(parts[1])
    shutil.rmtree(work, ignore_errors=True)
    return (busy - quiet / idle * loaded) / requests


def _control(pid: int, *args: str) -> None:
    subprocess.run(
        ["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=60
    )


def _total(out: Path) -> int:
    deadline = time.monotonic() + 30  # callgrind writes its file as the process exits
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    annotated = subprocess.run(
        ["callgrind_annotate", str(out)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    for line in annotated.splitlines():
        if "PROGRAM TOTALS" in line:
            return int(line.split()[0].replace(",", ""))
    raise RuntimeError(f"{out}: callgrind_annotate printed no PROGRAM TOTALS")


def instructions_mode(python: str, baseline: str | None, requests: int) -> dict[str, float]:
    """Rows `json` and `stream` per path (this checkout, and `landed` with `baseline`)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    paths = {"gateway": python, **({"gateway@landed": baseline} if baseline else {})}
    rows: dict[str, float] = {}
    # a stream lasts its backend's 16 x 25 ms: a tenth as many keep the run short
    for phase, stream, count in (("json", False, requests), ("stream", True, requests // 10)):
        for name, py in paths.items():
            rows[f"{phase} {name}"] = per_request(py, max(count, 20), stream)
            print(f"{phase:7s} {name:15s} {rows[f'{phase} {name}']:>12,.0f} instructions/request")
        if not stream:
            # Since #27 the gateway sends a non-streamed request to its replica as a stream
            # and assembles the answer (a stream's cost per answer, by design); the landed
            # code forwarded it as it came. Like for like: this checkout with that off.
            name = "gateway as-it-came"
            rows[f"json {name}"] = per_request(
                python, max(count, 20), False, ("--no-assemble-non-streamed",)
            )
            print(f"json    {name:15s} {rows[f'json {name}']:>12,.0f} instructions/request")
    if baseline:
        for phase, name in (
            ("json", "gateway"),
            ("json", "gateway as-it-came"),
            ("stream", "gateway"),
        ):
            ratio = rows[f"{phase} {name}"] / rows[f"{phase} gateway@landed"]
            print(f"instructions per request, {name} / landed: {phase} {ratio:.3f}")
    return rows
