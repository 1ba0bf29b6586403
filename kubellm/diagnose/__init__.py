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
    source = parser.add_argument_group("where the metrics come from")
    source.add_argument("--url", help="the gateway's base URL (its /metrics is scraped)")
    source.add_argument(
        "--engine-url",
        action="append",
        default=[],
        metavar="URL",
        help="an engine's base URL; repeat for each replica",
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
    parser.add_argument("--json", action="store_true", help="print the snapshot and findings")


def run(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    import httpx

    from kubellm.diagnose import collect, triage

    if args.samples < 1:
        print("kubellm diagnose: --samples: must be at least 1", file=sys.stderr)
        return 2
    if args.window <= 0:
        print("kubellm diagnose: --window: must be positive", file=sys.stderr)
        return 2
    try:
        if args.prometheus:
            snap = collect.from_prometheus(
                args.prometheus, args.window, args.ttft_target, args.itl_target
            )
        elif args.url or args.engine_url:
            snap = collect.scrape(
                args.url,
                args.engine_url,
                args.window,
                args.ttft_target,
                args.itl_target,
                samples=args.samples,
            )
        else:
            print(
                "kubellm diagnose: give --url (gateway), --engine-url or --prometheus",
                file=sys.stderr,
            )
            return 2
    except (httpx.HTTPError, collect.CollectError) as error:
        print(f"kubellm diagnose: {error}", file=sys.stderr)
        return 1
    findings = triage.triage(snap)
    if args.json:
        print(
            json.dumps(
                {"snapshot": snap.to_dict(), "findings": [asdict(f) for f in findings]}, indent=2
            )
        )
    else:
        print(triage.format_findings(snap, findings))
    return 0
