"""`kubellm status`: the state of a running local fleet, or of any kubellm gateway.

kubellm status                       # the fleet started by `kubellm up` here
kubellm status --url http://gw:8080  # a gateway (in a cluster, port-forwarded)
kubellm status --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n")[1]
    parser.add_argument("--url", help="a gateway's base URL (default: the local fleet's)")
    parser.add_argument("--run-dir", default=".kubellm/run", help="where `kubellm up` runs")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _get(url: str) -> str:
    import httpx

    try:
        response = httpx.get(url, timeout=5.0)
    except httpx.HTTPError:
        return ""
    return response.text if response.status_code == 200 else ""


def _ready_from_gateway(gateway_text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    from kubellm import metrics

    ready: dict[str, float] = {}
    for family in text_string_to_metric_families(gateway_text):
        if family.name == metrics.GATEWAY_READY_ENDPOINTS:
            for sample in family.samples:
                model = sample.labels.get("model", "")
                ready[model] = ready.get(model, 0) + sample.value
    return ready


def run(args: argparse.Namespace) -> int:
    from kubellm.fleet import status
    from kubellm.fleet.main import STATE_FILE

    state = None
    if args.url:
        gateway = args.url.rstrip("/")
    else:
        path = Path(args.run_dir) / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            print(
                f"kubellm status: no running fleet found ({path}); start one with "
                "`kubellm up -f FILE`, or give --url of a gateway",
                file=sys.stderr,
            )
            return 1
        gateway = state["gateway"]
    gateway_text = _get(f"{gateway}/metrics")
    if not gateway_text:
        print(f"kubellm status: the gateway at {gateway} does not answer", file=sys.stderr)
        return 1
    rows = []
    if state is not None:
        for deployment in state["deployments"].values():
            ready = [r for r in deployment["replicas"] if r["state"] == "ready"]
            texts = [_get(f"{r['url']}/metrics") for r in ready]
            row = status.model_row(
                deployment["model"],
                gateway_text,
                texts,
                ready=len(ready),
                desired=deployment["desired"],
            )
            row.adapters = deployment.get("adapters")
            rows.append(row)
    else:
        models = json.loads(_get(f"{gateway}/v1/models") or '{"data": []}')["data"]
        ready = _ready_from_gateway(gateway_text)
        for model in models:
            name = model["id"]
            count = int(ready.get(name, 0))
            rows.append(status.model_row(name, gateway_text, [], ready=count, desired=count))
    if args.json:
        print(json.dumps({"gateway": gateway, "models": [r.to_dict() for r in rows]}, indent=2))
    else:
        print(f"gateway {gateway}")
        print(status.format_table(rows))
        adapters = status.format_adapters(rows)
        if adapters:
            print()
            print(adapters)
    return 0
