"""The chart's tenants file reaches both front ends: the gateway and the endpoint picker
mount the one Secret the chart renders from `gateway.tenants`, with `--tenants` naming the
mounted file (and `--quota-redis` when set), and roll when the file changes."""

from __future__ import annotations

from typing import Any

import yaml
from kubellm.gateway.routing.flow import tenants

from kubellm import cli
from tests.helm.chart import of_kind, render_values

DIGEST = "sha256:" + "ab" * 32
TENANTS = {
    "tenants": [
        {"name": "chat-app", "apiKeys": [DIGEST], "priority": 10},
        {"name": "nightly-eval", "priority": -1, "fallback": "never"},
    ],
    "default": "chat-app",
}


def pods(values: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """component -> pod template, and the Secrets, of a render with `values`."""
    objs = render_values(values)
    templates = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["template"]
        for d in of_kind(objs, "Deployment")
    }
    return templates, of_kind(objs, "Secret")


def mounted_file(template: dict[str, Any], secrets: list[dict[str, Any]]) -> str:
    """The tenants file the pod's `--tenants` names, read from the Secret it mounts."""
    spec = template["spec"]
    (container,) = spec["containers"]
    (arg,) = [a for a in container["args"] if a.startswith("--tenants=")]
    path = arg.removeprefix("--tenants=")
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    (secret,) = [s for s in secrets if s["metadata"]["name"] == volume["secret"]["secretName"]]
    return secret["stringData"][path.removeprefix(mount["mountPath"] + "/")]


def test_the_picker_mounts_the_tenants_file_the_gateway_mounts() -> None:
    values = {
        "epp": {"enabled": True},
        "gateway": {"tenants": TENANTS, "quotaRedis": "redis://redis:6379/0"},
    }
    templates, secrets = pods(values)
    gateway, picker = templates["gateway"], templates["epp"]
    assert mounted_file(picker, secrets) == mounted_file(gateway, secrets)
    # the file is one the picker reads: the same tenants, the same default
    parsed = tenants.parse(yaml.safe_load(mounted_file(picker, secrets)))
    assert parsed.names() == ["chat-app", "nightly-eval"] and parsed.default == "chat-app"
    (container,) = picker["spec"]["containers"]
    assert "--quota-redis=redis://redis:6379/0" in container["args"]  # quotas hold across both
    args = cli.build_parser().parse_args(container["args"])  # flags `kubellm epp` accepts
    assert args.command == "epp" and args.tenants == "/etc/kubellm/tenants/tenants.yaml"
    # a change to the file rolls the picker's pods as it rolls the gateway's
    checksum = picker["metadata"]["annotations"]["checksum/tenants"]
    assert checksum == gateway["metadata"]["annotations"]["checksum/tenants"]
    fewer = {"tenants": TENANTS["tenants"][:1], "default": "chat-app"}
    changed = {**values, "gateway": {**values["gateway"], "tenants": fewer}}
    rolled, _ = pods(changed)
    assert rolled["epp"]["metadata"]["annotations"]["checksum/tenants"] != checksum


def test_a_picker_without_the_gateway_still_gets_the_file() -> None:
    values = {"epp": {"enabled": True}, "gateway": {"enabled": False, "tenants": TENANTS}}
    templates, secrets = pods(values)
    assert "gateway" not in templates
    assert "chat-app" in mounted_file(templates["epp"], secrets)


def test_without_tenants_the_picker_has_no_tenants_flag_nor_volume() -> None:
    templates, secrets = pods({"epp": {"enabled": True}})
    (container,) = templates["epp"]["spec"]["containers"]
    assert not any(a.startswith(("--tenants", "--quota-redis")) for a in container["args"])
    assert "tenants" not in {v["name"] for v in templates["epp"]["spec"].get("volumes", [])}
    assert not [s for s in secrets if s["metadata"]["name"].endswith("-tenants")]


def test_the_operators_pickers_share_the_gateways_quota_store() -> None:
    """Per-pool pickers (operator.endpointPicker.mode perPool) whose LLMDeployment names a
    tenants Secret get the chart's gateway.quotaRedis, so one tenant's quota is counted once
    whichever front end its requests come through; the operator accepts the flag."""
    from tests.helm.test_epp_pool import operator_args

    args = operator_args({"gateway": {"quotaRedis": "redis://redis:6379/0"}})
    assert "--epp-quota-redis=redis://redis:6379/0" in args
    parsed = cli.build_parser().parse_args(args)
    assert parsed.epp_quota_redis == "redis://redis:6379/0"
    assert not any(a.startswith("--epp-quota-redis") for a in operator_args({}))
