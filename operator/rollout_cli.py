"""`kubellm rollout abort|promote|status NAME`: act on a canary rollout by hand.

abort and promote set the `kubellm.io/rollout-action` annotation (the same as `kubectl
annotate llmd NAME kubellm.io/rollout-action=abort`); the operator acts on it once and
removes it. status prints `status.rollout` and the RolledBack condition.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from kubellm.contracts import ROLLOUT_ACTION_ANNOTATION, ROLLOUT_ACTIONS


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=[*ROLLOUT_ACTIONS, "status"])
    parser.add_argument("name", help="the LLMDeployment")
    parser.add_argument("-n", "--namespace", default=None, help="default: the kubeconfig's")


def action_patch(action: str) -> dict[str, Any]:
    """The merge patch that asks the operator for `action` (abort or promote)."""
    if action not in ROLLOUT_ACTIONS:
        raise ValueError(f"unknown rollout action {action!r}: one of {', '.join(ROLLOUT_ACTIONS)}")
    return {"metadata": {"annotations": {ROLLOUT_ACTION_ANNOTATION: action}}}


def describe(name: str, status: Mapping[str, Any] | None) -> str:
    """A few lines a person reads: revisions, phase, step, weight, the last verdict."""
    status = status or {}
    rollout = status.get("rollout") or {}
    if not rollout:
        return f"{name}: no rollout recorded yet (is the operator running?)"
    lines = [
        f"{name}: {rollout.get('phase', '?')}  revision {rollout.get('revision', '?')}  "
        f"stable {rollout.get('stableRevision', '?')}  canary weight "
        f"{rollout.get('canaryWeight', 0)}%"
    ]
    if rollout.get("step"):
        lines.append(f"  step {rollout['step']}/{rollout.get('steps', '?')}")
    if rollout.get("message"):
        lines.append(f"  {rollout['message']}")
    verdict = rollout.get("verdict") or {}
    if verdict:
        lines.append(f"  analysis: {verdict.get('result')} ({verdict.get('reason')}): "
                     f"{verdict.get('message', '')}")  # fmt: skip
    for cond in status.get("conditions") or []:
        if cond.get("type") == "RolledBack" and cond.get("status") == "True":
            lines.append(f"  rolled back: {cond.get('reason')}: {cond.get('message', '')}")
    return "\n".join(lines)


async def act(http: Any, namespace: str, name: str, action: str) -> tuple[int, str]:
    """Do `action` on LLMDeployment namespace/name through `http` (an httpx.AsyncClient on
    the API server); (exit status, what to print)."""
    import json

    from kubellm import kube

    path = kube.llmd_path(namespace, name)
    if action == "status":
        response = await http.get(path)
    else:
        response = await http.patch(
            path,
            content=json.dumps(action_patch(action)),
            headers={"Content-Type": "application/merge-patch+json"},
        )
    if response.status_code == 404:
        return 1, f"no LLMDeployment {namespace}/{name}"
    if response.status_code >= 400:
        return 1, f"the API server refused ({response.status_code}): {response.text[:500]}"
    if action == "status":
        return 0, describe(name, response.json().get("status"))
    return 0, (f"asked the operator to {action} the rollout of {namespace}/{name} "
               f"(annotation {ROLLOUT_ACTION_ANNOTATION}={action})")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kubellm import kube

    config = kube.load()
    namespace = args.namespace or config.namespace or "default"

    async def main() -> tuple[int, str]:
        async with kube.async_client(config) as http:
            return await act(http, namespace, args.name, args.action)

    code, text = asyncio.run(main())
    print(text, file=sys.stderr if code else sys.stdout)
    return code
