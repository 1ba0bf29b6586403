"""`kubellm diagnose`: say what is slow in a fleet, and why, from its metrics.

Scrapes the gateway's and engines' /metrics twice, `--window` seconds apart
(or asks a Prometheus server for the same figures over that window), distils
a `Snapshot` (snapshot.py) and walks the serving triage tree (triage.py).
Imports stay light here: `kubellm` loads this module to build its parser.
"""

from __future__ import annotations

import argparse
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Explain what is slow in a fleet from its metrics. With no --url, --engine-url or "
        "--prometheus it diagnoses the local fleet that `kubellm up` runs here (its gateway "
        "and every ready engine, found the way `kubellm status` finds them)."
    )
    source = parser.add_argument_group("where the metrics come from")
    source.add_argument(
        "--url",
        help="the gateway's base URL (its /metrics is scraped, and names the engines behind "
        "it; with `kubellm gateway --metrics-port`, that port's URL; default: the local "
        "fleet's)",
    )
    source.add_argument(
        "--engine-url",
        action="append",
        default=[],
        metavar="URL",
        help="an engine's base URL; repeat for each replica (default: those the gateway names)",
    )
    source.add_argument(
        "--prometheus", metavar="URL", help="a Prometheus server to query instead of scraping"
    )
    parser.add_argument(
        "--window",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds between the two scrapes (default 30)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=5,
        metavar="N",
        help="engine gauges are sampled N times across the window (default 5)",
    )
    parser.add_argument(
        "--ttft-target",
        type=float,
        metavar="S",
        help="TTFT target (default: the gateway's, else 2s)",
    )
    parser.add_argument(
        "--itl-target",
        type=float,
        metavar="S",
        help="ITL target (default: the gateway's, else 0.25s)",
    )
    source.add_argument(
        "--run-dir",
        default=".kubellm/run",
        help="where `kubellm up` runs: its fleet.json names the gateway and the engines "
        "(default .kubellm/run)",
    )
    parser.add_argument(
        "-f",
        "--filename",
        metavar="FILE",
        help="the LLMDeployment manifest, so advice names what to change in it "
        "(default: the local fleet's, when it runs one model)",
    )
    parser.add_argument("--json", action="store_true", help="print the snapshot and findings")


def _spec(args: argparse.Namespace, recorded: dict[str, dict]) -> object | None:
    """The spec the advice is worded for: -f FILE, else the local fleet's only model."""
    from kubellm import api, manifests

    if args.filename:
        deployments = list(manifests.load(args.filename))
        return deployments[0].spec if len(deployments) == 1 else None
    if len(recorded) == 1:
        try:
            return api.LLMDeploymentSpec.model_validate(next(iter(recorded.values())))
        except ValueError:
            return None
    return None


def run(args: argparse.Namespace) -> int:
    import json
    import math
    import time
    from dataclasses import asdict

    import httpx

    from kubellm import manifests
    from kubellm.diagnose import collect, triage
    from kubellm.progress import Ticker

    if args.samples < 1:
        print("kubellm diagnose: --samples: must be at least 1", file=sys.stderr)
        return 2
    if not args.window > 0 or not math.isfinite(args.window):
        print("kubellm diagnose: --window: must be a positive number of seconds", file=sys.stderr)
        return 2
    gateway, engines, recorded = args.url, list(args.engine_url), {}
    if not (args.prometheus or args.url or args.engine_url):
        fleet = collect.local_fleet(args.run_dir)
        if fleet is None:
            print(
                f"kubellm diagnose: no running fleet found ({args.run_dir}/fleet.json): start "
                "one with `kubellm up -f FILE`, or give --url (a gateway), --engine-url or "
                "--prometheus",
                file=sys.stderr,
            )
            return 2
        gateway, engines, recorded = fleet.gateway, fleet.engines, fleet.specs
    elif args.url and not args.engine_url:
        # The local fleet's gateway: its engines are known without asking for their ports.
        fleet = collect.local_fleet(args.run_dir)
        if fleet is not None and fleet.gateway.rstrip("/") == args.url.rstrip("/"):
            engines, recorded = fleet.engines, fleet.specs
        else:  # any gateway names its engines on its /metrics (kubellm_gateway_endpoint_info)
            try:
                engines = collect.engines_behind(args.url)
            except collect.CollectError as error:
                print(f"kubellm diagnose: {error}", file=sys.stderr)
                return 1
    try:
        spec = _spec(args, recorded)
    except manifests.ManifestError as error:
        print(f"kubellm diagnose: {error}", file=sys.stderr)
        return 1
    where = args.prometheus or ", ".join(
        [*([f"gateway {gateway}"] if gateway else []), f"{len(engines)} engine(s)"]
    )
    ticker = Ticker(f"kubellm diagnose: watching {where} for {args.window:g}s")
    taken = 0

    def wait(seconds: float) -> None:
        nonlocal taken
        time.sleep(seconds)
        taken += 1
        ticker.note(f"sample {taken}/{args.samples}")

    try:
        with ticker:
            if args.prometheus:
                snap = collect.from_prometheus(
                    args.prometheus, args.window, args.ttft_target, args.itl_target
                )
            else:
                snap = collect.scrape(
                    gateway,
                    engines,
                    args.window,
                    args.ttft_target,
                    args.itl_target,
                    samples=args.samples,
                    wait=wait,
                )
    except (httpx.HTTPError, collect.CollectError) as error:
        print(f"kubellm diagnose: {error}", file=sys.stderr)
        return 1
    findings = triage.triage(snap, spec=spec)  # type: ignore[arg-type]
    if args.json:
        print(
            json.dumps(
                {"snapshot": snap.to_dict(), "findings": [asdict(f) for f in findings]}, indent=2
            )
        )
    else:
        print(triage.format_findings(snap, findings))
    return 0
