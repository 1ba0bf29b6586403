"""spec.routing.prefixIndex precise turns vLLM's KV-cache events on, on the spec's port,
and the engine pod exposes them; approximate (the default) leaves vLLM as it was."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubellm.engine import launcher
from kubellm.operator import builders

from kubellm import manifests

SPEC: dict[str, Any] = {"model": {"source": "hf://meta-llama/Llama-3.1-8B", "servedName": "x"}}


def _config(routing: dict[str, Any] | None, host: str) -> dict[str, Any] | None:
    document = copy.deepcopy(SPEC)
    if routing is not None:
        document["routing"] = routing
    argv = launcher.build_command(launcher.parse_target(document), host=host, environ={}).argv
    if "--kv-events-config" not in argv:
        return None
    return json.loads(argv[argv.index("--kv-events-config") + 1])


# (spec.routing, launcher host, publish endpoint, replay endpoint; None: events off)
TABLE = [
    (None, "0.0.0.0", None, None),
    ({"prefixIndex": "approximate"}, "0.0.0.0", None, None),
    ({"prefixIndex": "precise"}, "0.0.0.0", "tcp://*:5557", "tcp://*:5558"),
    ({"prefixIndex": "precise", "kvEventsPort": 7100}, "0.0.0.0", "tcp://*:7100", "tcp://*:7101"),
    # vLLM binds only endpoints holding '*' or '::': a specific host is written IPv4-mapped.
    ({"prefixIndex": "precise"}, "127.0.0.1", "tcp://[::ffff:127.0.0.1]:5557",
     "tcp://127.0.0.1:5558"),
]  # fmt: skip


@pytest.mark.parametrize(("routing", "host", "publish", "replay"), TABLE)
def test_kv_events_flag(
    routing: dict[str, Any] | None, host: str, publish: str | None, replay: str | None
) -> None:
    config = _config(routing, host)
    if publish is None:
        assert config is None
        return
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": publish, "replay_endpoint": replay}  # fmt: skip


def test_the_flag_comes_before_extra_args_so_a_user_can_override_it() -> None:
    document = copy.deepcopy(SPEC)
    document["routing"] = {"prefixIndex": "precise"}
    document["engine"] = {"extraArgs": ["--kv-events-config", "{}"]}
    argv = launcher.build_command(launcher.parse_target(document), environ={}).argv
    assert argv.index("--kv-events-config") < len(argv) - 2


@pytest.mark.parametrize("bad", [{"prefixIndex": "exact"}, {"kvEventsPort": 65535},
                                 {"kvEventsPort": 0}])  # fmt: skip
def test_bad_routing_fields_are_refused_naming_the_field(bad: dict[str, Any]) -> None:
    document = copy.deepcopy(SPEC)
    document["routing"] = bad
    with pytest.raises(Exception, match=next(iter(bad))):
        launcher.parse_target(document)


def _ports(routing: dict[str, Any] | None) -> list[dict[str, Any]]:
    document: dict[str, Any] = {
        "apiVersion": "kubellm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "m", "namespace": "ns"},
        "spec": copy.deepcopy(SPEC),
    }
    if routing is not None:
        document["spec"]["routing"] = routing
    deployment = builders.engine_deployment(manifests.parse(document))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["ports"]


def test_the_engine_pod_exposes_the_event_ports_only_in_precise_mode() -> None:
    assert [p["name"] for p in _ports(None)] == [builders.PORT_NAME]
    ports = _ports({"prefixIndex": "precise", "kvEventsPort": 7100})
    assert [(p["name"], p["containerPort"]) for p in ports[1:]] == [
        ("kv-events", 7100),
        ("kv-replay", 7101),
    ]


def _llmd(routing: dict[str, Any] | None) -> Any:
    document: dict[str, Any] = {
        "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": "m", "namespace": "ns"}, "spec": copy.deepcopy(SPEC),
    }  # fmt: skip
    if routing is not None:
        document["spec"]["routing"] = routing
    return manifests.parse(document)


def test_the_mounted_engine_spec_carries_precise_mode_so_the_pod_turns_events_on() -> None:
    """The launcher in the pod reads the ConfigMap's engine spec, not the LLMDeployment: the
    document keeps prefixIndex precise and its port (approximate specs keep the document
    they had, so their pods do not restart)."""
    from kubellm import contracts

    precise = _llmd({"prefixIndex": "precise", "kvEventsPort": 7100, "loadBound": 2})
    document = contracts.engine_spec_document(precise)
    assert document["spec"]["routing"] == {"prefixIndex": "precise", "kvEventsPort": 7100}
    argv = launcher.build_command(launcher.parse_target(document), environ={}).argv
    assert json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:7100"
    assert contracts.engine_spec_json(_llmd(None)) == contracts.engine_spec_json(
        _llmd({"prefixIndex": "approximate", "loadBound": 2})
    )


def test_a_local_replica_publishes_on_the_port_it_is_given(tmp_path: Any) -> None:
    """`kubellm engine --kv-events-port` (a local fleet's replicas share one host): vLLM's
    flag and the simulator's port follow it; without it both use the spec's."""
    from kubellm.engine import cli

    document = copy.deepcopy(SPEC)
    document["routing"] = {"prefixIndex": "precise"}
    target = launcher.parse_target(document)
    argv = launcher.build_command(target, host="127.0.0.1", environ={}, kv_events_port=7200).argv
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert (config["endpoint"], config["replay_endpoint"]) == (
        "tcp://[::ffff:127.0.0.1]:7200", "tcp://127.0.0.1:7201",
    )  # fmt: skip
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(document))
    assert cli.sim_kv_events_port(str(path), None) == 5557
    assert cli.sim_kv_events_port(str(path), 7200) == 7200
    path.write_text(json.dumps(SPEC))
    assert cli.sim_kv_events_port(str(path), None) is None
