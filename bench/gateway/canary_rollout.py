"""A canary rollout on the local fleet, under steady load: a good revision promoted, a slow one
rolled back, the stable revision's prefix-cache hit rate kept (issue 29's acceptance).

Starts `kubellm up --engine sim --watch` on loopback with one manifest (Llama 3.1 8B H100
profile, real time), keeps a bounded load of streamed chats over a few shared system
prompts, and edits the manifest twice:

1. a good revision (a new model source): it should go through every step and end as the
   only revision, no request failing;
2. a bad revision (the next source, its simulated engines 3x slower per step through the
   `kubellm.io/sim-slow-steps` annotation): it should be rolled back within its first
   analysis window, the canary having answered fewer than weight x (the requests of one
   window), no request failing;
3. the stable revision's prefix-cache hit rate (its engines' vllm:prefix_cache_* deltas)
   over a window before the bad revision and one after its rollback: within 5 points.

    python -m bench.canary_rollout [--replicas 3] [--concurrency 4] [--json FILE]

Prints each figure; `tests/bench/test_canary_rollout.py` runs it and checks them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kubellm.fleet.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
NAME = "canary"
SLOW = 3.0
HIT_POINTS = 5.0


def manifest(source: str, replicas: int, steps: list[dict[str, int]], min_requests: int,
             annotations: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "kubellm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": NAME, **({"annotations": annotations} if annotations else {})},
        "spec": {
            "model": {"source": source, "servedName": NAME},
            "replicas": replicas,
            "slo": {"ttftSeconds": 1.0, "itlSeconds": 0.1},
            "rollout": {
                "strategy": "Canary",
                "steps": steps,
                "analysis": {"minRequests": min_requests, "maxTTFTRatio": 1.8,
                             "maxITLRatio": 1.8},
            },
        },
    }  # fmt: skip


@dataclass
class Load:
    """A bounded closed-loop load: `concurrency` clients, shared system prompts, streamed."""

    url: str
    concurrency: int
    prefixes: int
    seed: int
    max_requests: int = 20_000
    deadline: float = 600.0
    done: list[tuple[float, bool]] = field(default_factory=list)  # (end time, ok)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        systems = [f"You are assistant {k} of the canary bench; answer briefly. " * 12
                   for k in range(self.prefixes)]  # fmt: skip
        end = time.monotonic() + self.deadline
        with httpx.Client(timeout=30.0) as http:
            while not self.stop.is_set() and time.monotonic() < end:
                if len(self.done) >= self.max_requests:
                    return
                body = {
                    "model": NAME,
                    "stream": True,
                    "max_tokens": 16,
                    "messages": [
                        {"role": "system", "content": rng.choice(systems)},
                        {"role": "user", "content": f"question {rng.randrange(10**6)}"},
                    ],
                }
                ok, why = False, ""
                try:
                    with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                        text = "".join(r.iter_text())
                        ok = r.status_code == 200 and "[DONE]" in text
                        why = f"status {r.status_code}" if r.status_code != 200 else "no [DONE]"
                except httpx.HTTPError as error:
                    why = type(error).__name__
                self.done.append((time.monotonic(), ok))
                if not ok:
                    self.failures.append(why)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                   for i in range(self.concurrency)]  # fmt: skip
        for thread in threads:
            thread.start()
        return threads

    def rate(self, since: float, until: float) -> float:
        count = sum(1 for t, _ in self.done if since <= t < until)
        return count / max(until - since, 1e-9)


class Fleet:
    def __init__(self, path: Path, run_dir: Path, port: int, log: Path,
                 engine: str = "sim") -> None:  # fmt: skip
        self.path, self.run_dir, self.port, self.log = path, run_dir, port, log
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "kubellm.cli", "up", "--engine", engine, "--watch",
                "--port", str(port), "--run-dir", str(run_dir), "--status-interval", "0",
                "--rollout-seconds", "0.5", "-f", str(path)]  # fmt: skip
        with log.open("w") as out:
            self.process = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def state(self) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "fleet.json").read_text())["deployments"][NAME]
        except (OSError, ValueError, KeyError):
            return {}

    def rollout(self) -> dict[str, Any]:
        return self.state().get("rollout") or {}

    def ready(self) -> list[str]:
        return [r["url"] for r in self.state().get("replicas", []) if r["state"] == "ready"]

    def metrics(self) -> str:
        try:
            return httpx.get(f"{self.url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


def wait(predicate: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"waited {timeout:.0f} s for {what}")


def revision_requests(text: str, revision: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "kubellm_gateway_revision_requests_total"
                    and sample.labels.get("revision") == revision):  # fmt: skip
                total += sample.value
    return total


def cache_counts(urls: list[str]) -> tuple[float, float]:
    """(hits, queries) summed over engines' vllm:prefix_cache_* counters."""
    hits = queries = 0.0
    for url in urls:
        try:
            text = httpx.get(f"{url}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


def hit_rate(fleet: Fleet, seconds: float) -> float:
    urls = fleet.ready()
    h0, q0 = cache_counts(urls)
    time.sleep(seconds)  # a measurement window of the bench, not synchronisation
    h1, q1 = cache_counts(urls)
    return 100.0 * (h1 - h0) / max(q1 - q0, 1.0)


@contextlib.contextmanager
def loaded_fleet(doc: dict[str, Any], replicas: int, load_args: tuple[int, int, int],
                 out: dict[str, Any], engine: str = "sim",
                 start_timeout: float = 60.0) -> Iterator[tuple[Path, Fleet, Load]]:  # fmt: skip
    """`kubellm up --engine ENGINE --watch` on `doc`, its stable replicas ready, a bounded load
    running (`load_args`: concurrency, prefixes, seed): (manifest path, fleet, load). On the
    way out the load and the fleet stop and `out["fleet_log_tail"]` keeps the log's end."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "canary.yaml"
        path.write_text(yaml.safe_dump(doc))
        fleet = Fleet(path, Path(tmp) / "run", free_port(), Path(tmp) / "fleet.log", engine)
        load = Load(fleet.url, *load_args, deadline=start_timeout + 600.0)
        threads: list[threading.Thread] = []
        try:
            wait(lambda: len(fleet.ready()) == replicas, start_timeout, "the stable replicas")
            threads = load.start()
            yield path, fleet, load
        finally:
            load.stop.set()
            fleet.stop()
            for thread in threads:
                thread.join(timeout=35)
            out["fleet_log_tail"] = fleet.log.read_text()[-3000:] if fleet.log.exists() else ""


def run(*, replicas: int = 3, concurrency: int = 4, prefixes: int = 40, seed: int = 7,
        pause: int = 8, min_requests: int = 15, warm: float = 6.0,
        timeout: float = 180.0) -> dict[str, Any]:  # fmt: skip
    from kubellm import api
    from kubellm.contracts import revision

    steps = [{"weight": 20, "pauseSeconds": pause}, {"weight": 50, "pauseSeconds": pause}]
    sources = ["file:///sim/model-v1", "file:///sim/model-v2", "file:///sim/model-v3"]
    docs = [
        manifest(sources[0], replicas, steps, min_requests),
        manifest(sources[1], replicas, steps, min_requests),
        manifest(sources[2], replicas, steps, min_requests,
                 {"kubellm.io/sim-slow-steps": f"{SLOW:g}"}),
    ]  # fmt: skip
    revs = [revision(api.LLMDeployment.model_validate(d)) for d in docs]
    out: dict[str, Any] = {"revisions": revs, "steps": steps}
    with loaded_fleet(docs[0], replicas, (concurrency, prefixes, seed), out) as (path, fleet, load):
        time.sleep(warm)  # warm the caches under load

        # 1. a good revision: promoted through every step
        t0 = time.monotonic()
        path.write_text(yaml.safe_dump(docs[1]))
        wait(lambda: fleet.rollout().get("canaryRevision") == revs[1], 30, "the canary")
        wait(lambda: fleet.rollout().get("phase") == "Stable"
             and fleet.rollout().get("revision") == revs[1], timeout,
             "the good revision promoted")  # fmt: skip
        wait(lambda: not fleet.state().get("canaryReplicas")
             and len(fleet.ready()) == replicas, 60, "the canary gone")  # fmt: skip
        log = fleet.log.read_text()
        out["good"] = {
            "promoted_after_s": round(time.monotonic() - t0, 1),
            "steps_passed": len(re.findall(r"CanaryStep: step \d+ passed", log))
            + len(re.findall(r"passed all \d+ steps", log)),
            "promoted": f"{NAME}: Normal Promoted" in log,
            "failed_requests": len(load.failures),
            "revisions_left": sorted({revs[1]}),
        }
        time.sleep(warm)  # the promoted replicas' caches warm up
        before = hit_rate(fleet, 8.0)

        # 2. a bad revision (3x slower steps): rolled back within its first window
        failures_before = len(load.failures)
        t1 = time.monotonic()
        path.write_text(yaml.safe_dump(docs[2]))
        wait(lambda: fleet.rollout().get("stepStartedAt")
             and fleet.rollout().get("canaryRevision") == revs[2], 60,
             "the bad canary's window")  # fmt: skip
        opened = time.monotonic()
        status = wait(lambda: (r := fleet.rollout()).get("phase") == "RolledBack" and r,
                      timeout, "the bad revision rolled back")  # fmt: skip
        rolled = time.monotonic()
        affected = revision_requests(fleet.metrics(), revs[2])
        rate = load.rate(t0, rolled)
        weight = steps[0]["weight"]
        out["bad"] = {
            "rolled_back_after_s": round(rolled - t1, 1),
            "window_open_to_rollback_s": round(rolled - opened, 1),
            "pause_s": pause,
            "reason": status.get("rolledBackReason"),
            "verdict": (status.get("verdict") or {}).get("message", ""),
            "step": status.get("step"),
            "canary_requests": int(affected),
            "requests_per_s": round(rate, 1),
            "bound_weight_x_window_requests": round(weight / 100 * rate * pause, 1),
            "failed_requests": len(load.failures) - failures_before,
        }
        wait(lambda: not [r for r in fleet.state().get("canaryReplicas", [])
                          if r["state"] == "ready"], 60, "the canary drained")  # fmt: skip
        after = hit_rate(fleet, 8.0)
        out["hit_rate"] = {"before_pct": round(before, 1), "after_pct": round(after, 1),
                           "delta_points": round(after - before, 1)}  # fmt: skip
        out["total_requests"] = len(load.done)
        out["total_failed"] = len(load.failures)
    return out


def shadow_run(*, replicas: int = 2, concurrency: int = 4, prefixes: int = 40, seed: int = 7,
               timeout: float = 180.0) -> dict[str, Any]:  # fmt: skip
    """A whole rollout with a shadow step on `kubellm up --engine sim --watch`: a new source
    (the simulator answers it as the old one: identical revisions) goes through the shadow
    step (weight 0: mirrored requests only, the quality gate) and a 50% step to promotion.
    Figures: the shadow step's verdict, the mirrored requests it needed, the real requests
    the canary took before it (0: no traffic share before the quality verdict)."""
    from kubellm import api
    from kubellm.contracts import revision

    steps = [{"weight": 0, "pauseSeconds": 2}, {"weight": 50, "pauseSeconds": 2}]
    docs = [manifest(f"file:///sim/model-v{i}", replicas, steps, 15) for i in (1, 2)]
    for doc in docs:
        doc["spec"]["rollout"]["shadow"] = {"share": 0.5}
        doc["spec"]["rollout"]["analysis"]["quality"] = {"minMirroredRequests": 20}
    rev = revision(api.LLMDeployment.model_validate(docs[1]))
    out: dict[str, Any] = {"revision": rev}
    with loaded_fleet(docs[0], replicas, (concurrency, prefixes, seed), out) as (path, fleet, load):
        path.write_text(yaml.safe_dump(docs[1]))
        shadow = wait(lambda: (r := fleet.rollout()).get("canaryRevision") == rev
                      and (r.get("step", 1) > 1 or r.get("phase") != "Progressing")
                      and r, timeout, "the shadow step's verdict")  # fmt: skip
        verdict = shadow.get("verdict") or {}
        figures = verdict.get("canary") or {}
        # the shadow step's verdict stays in status until the 50% step's first one
        out["shadow"] = {"phase": shadow.get("phase"), "step": shadow.get("step"),
                         "verdict": verdict.get("message"),
                         "mirrored": figures.get("mirrored"),
                         "agreement": figures.get("agreement"),
                         "canary_real_requests": figures.get("requests", 0)}  # fmt: skip
        final = wait(lambda: (r := fleet.rollout()).get("phase") in ("Stable", "RolledBack")
                     and r.get("revision") == rev and r, timeout,
                     "the rollout's end")  # fmt: skip
        out["final"] = {"phase": final.get("phase"), "reason": final.get("rolledBackReason")}
        out["failed_requests"] = len(load.failures)
    return out


def vllm_shadow_run(*, concurrency: int = 4, prefixes: int = 40, seed: int = 7,
                    timeout: float = 900.0,
                    names: tuple[str, ...] = ("same", "4bit")) -> dict[str, Any]:  # fmt: skip
    """The shadow step on `kubellm up --engine vllm --watch` (real vLLM on CPU, the tiny
    checkpoint, one replica): the same weights under a new source (identical revisions:
    promoted through the shadow step and a 50% step), then the weights rounded to 4 bits
    (rolled back in the shadow step). The clients sample (the engine's default decoding):
    each drawn request gets a seed from the gateway, so the one busy stable replica is never
    asked again. Shipped quality defaults (minMirroredRequests 50), share 0.5, no SLO (a
    tiny CPU engine on shared cores has none to keep). `names`: which of the two, in order."""
    from bench.gateway.shadow_quality import round_to_4_bits
    from kubellm import api
    from kubellm.contracts import revision
    from tests.fixtures import engines

    base = engines.ensure_tiny_model()
    steps = [{"weight": 0, "pauseSeconds": 2}, {"weight": 50, "pauseSeconds": 2}]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        same, rounded = Path(tmp) / "same", Path(tmp) / "4bit"
        same.symlink_to(base, target_is_directory=True)
        round_to_4_bits(base, rounded)
        docs = []
        for directory in (base, same, rounded):
            doc = manifest(f"file://{directory}", 1, steps, 15)
            spec = doc["spec"]
            spec.pop("slo")
            spec["engine"] = {"dtype": "float32", "maxModelLen": engines.TINY_MAX_MODEL_LEN,
                              "blockSize": engines.TINY_BLOCK_SIZE,
                              "extraArgs": list(engines.TINY_EXTRA_ARGS)}  # fmt: skip
            spec["resources"] = {"gpu": {"count": 0}}
            spec["rollout"]["shadow"] = {"share": 0.5}
            spec["rollout"]["analysis"]["quality"] = {}
            docs.append(doc)
        revs = [revision(api.LLMDeployment.model_validate(d)) for d in docs]
        load_args = (concurrency, prefixes, seed)  # the load lasts the engines' starts too
        with loaded_fleet(docs[0], 1, load_args, out, "vllm", timeout) as (path, fleet, load):
            for name, doc, rev in zip(("same", "4bit"), docs[1:], revs[1:], strict=True):
                if name not in names:
                    continue
                t0 = time.monotonic()
                path.write_text(yaml.safe_dump(doc))
                ready: list[float] = []  # when the canary's engine answered /health

                def canary_up(ready: list[float] = ready, t0: float = t0) -> bool:
                    if not ready and any(
                        r["state"] == "ready" for r in fleet.state().get("canaryReplicas", [])
                    ):
                        ready.append(time.monotonic() - t0)  # fmt: skip
                    return True

                shadow = wait(lambda rev=rev: canary_up()
                              and (r := fleet.rollout()).get("canaryRevision") == rev
                              and (r.get("step", 1) > 1 or r.get("phase") != "Progressing")
                              and r, timeout, f"{name}: the shadow step's verdict")  # fmt: skip
                verdict = shadow.get("verdict") or {}
                figures = verdict.get("canary") or {}
                final = wait(lambda rev=rev: (r := fleet.rollout()).get("revision") == rev
                             and r.get("phase") in ("Stable", "RolledBack") and r, timeout,
                             f"{name}: the rollout's end")  # fmt: skip
                out[name] = {"shadow_step": shadow.get("step"), "shadow_phase": shadow.get("phase"),
                             "verdict": verdict.get("message"), "mirrored": figures.get("mirrored"),
                             "agreement": figures.get("agreement"),
                             "token_agreement": figures.get("tokenAgreement"),
                             "real_before_verdict": figures.get("requests", 0),
                             "final": final.get("phase"), "reason": final.get("rolledBackReason"),
                             "seconds": round(time.monotonic() - t0, 1),
                             "canary_ready_s": round(ready[0], 1) if ready else None,
                             "binds": re.findall(r"(\S+) starting on port \d+ \(pid \d+; "
                                                 r"VLLM_CPU_OMP_THREADS_BIND=([^)]*)\)",
                                                 fleet.log.read_text()),
                             "vllm_core_ids": _core_ids(fleet.run_dir / "logs"),
                             "load_average": [round(x, 1) for x in os.getloadavg()],
                             "failed_requests": len(load.failures)}  # fmt: skip
                print(f"{name}: {json.dumps(out[name])}", flush=True)
                wait(lambda: not fleet.state().get("canaryReplicas"), 120, "the canary gone")
            out["requests"] = len(load.done)
            out["shed"] = {k: v for k, v in _shed(fleet.metrics()).items() if v}
    return out


def _core_ids(logs: Path) -> dict[str, list[str]]:
    """The cores each replica's vLLM bound its OpenMP threads to, from its own log line."""
    pattern = re.compile(r"local_rank=\d+, core ids=(\[[^]]*\])")
    return {p.stem: pattern.findall(p.read_text(errors="replace"))
            for p in sorted(logs.glob("*.log"))}  # fmt: skip


def _shed(text: str) -> dict[str, float]:
    """kubellm_gateway_mirror_shed_total by reason."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kubellm_gateway_mirror_shed_total":
                reason = sample.labels.get("reason", "")
                out[reason] = out.get(reason, 0.0) + sample.value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pause", type=int, default=8, help="each step's pauseSeconds")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--shadow",
        action="store_true",
        help="instead: a whole rollout through a shadow step (shadow_run)",
    )
    parser.add_argument("--only", nargs="*", default=["same", "4bit"],
                        help="with --vllm: the revisions, in order (same 4bit)")  # fmt: skip
    parser.add_argument("--vllm", action="store_true",
                        help="with --shadow: real vLLM on CPU (vllm_shadow_run; under "
                        "flock /tmp/vllm.lock)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.shadow and args.vllm:
        figures = vllm_shadow_run(concurrency=args.concurrency, seed=args.seed,
                                  names=tuple(args.only))  # fmt: skip
        tail = figures.pop("fleet_log_tail")
        print(json.dumps(figures))
        same, rounded = figures.get("same"), figures.get("4bit")
        ok = ((same is None or same["final"] == "Stable")
              and (rounded is None or (rounded["final"] == "RolledBack"
                                       and rounded["shadow_step"] == 1
                                       and rounded["real_before_verdict"] == 0)))  # fmt: skip
        print("acceptance:", "met" if ok else f"NOT met\n{tail}")
        return 0 if ok else 1
    if args.shadow:
        figures = shadow_run(concurrency=args.concurrency, seed=args.seed)
        figures.pop("fleet_log_tail")
        print(json.dumps(figures))
        ok = (figures["shadow"]["canary_real_requests"] == 0
              and figures["final"]["phase"] == "Stable")  # fmt: skip
        print("acceptance:", "met" if ok else "NOT met")
        return 0 if ok else 1
    figures = run(replicas=args.replicas, concurrency=args.concurrency, pause=args.pause,
                  seed=args.seed)  # fmt: skip
    tail = figures.pop("fleet_log_tail")
    for key, value in figures.items():
        print(f"{key}: {json.dumps(value)}")
    if args.json:
        args.json.write_text(json.dumps({**figures, "fleet_log_tail": tail}, indent=2))
    good, bad, hits = figures["good"], figures["bad"], figures["hit_rate"]
    ok = (good["promoted"] and good["failed_requests"] == 0 and bad["failed_requests"] == 0
          and bad["canary_requests"] < bad["bound_weight_x_window_requests"]
          and abs(hits["delta_points"]) <= HIT_POINTS)  # fmt: skip
    print("acceptance:", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
