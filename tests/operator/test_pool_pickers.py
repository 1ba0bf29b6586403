"""Table tests of the pure builders for spec.routing.inferencePool's endpoint picker and
HTTPRoute: which picker a pool names, the picker the operator runs for a pool alone, and
the route's request timeout (checked against the HTTPRoute schema in tests/helm)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from kubellm.gateway.http.settings import GatewaySettings
from kubellm.operator import builders

from kubellm import contracts

from .test_builders import KUBERNETES_VERSIONS, llmd

POOL: dict[str, Any] = {"routing": {"inferencePool": {"parentRefs": [{"name": "gw"}]}}}
WITH_CRDS = builders.Options(owner_uid="u-1", inference_pool=True, http_route=True)
SHARED = builders.Options(
    owner_uid="u-1", inference_pool=True, http_route=True,
    picker=builders.PickerOptions(shared="kubellm-epp"),
)  # fmt: skip


def pool_spec(**picker: Any) -> dict[str, Any]:
    return {
        "routing": {"inferencePool": {"endpointPicker": picker, "parentRefs": [{"name": "gw"}]}}
    }


def by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.mark.parametrize(
    ("picker", "options", "own", "service"),
    [
        ({}, WITH_CRDS, True, "m-epp"),  # the default: a picker for this pool alone
        ({"name": "team-a-epp"}, WITH_CRDS, False, "team-a-epp"),  # the spec names one
        ({}, SHARED, False, "kubellm-epp"),  # the operator was told of a shared one
        ({"name": "team-a-epp"}, SHARED, False, "team-a-epp"),  # the spec wins
    ],
)
def test_which_picker_a_pool_names(picker, options, own, service) -> None:
    deployment = llmd(pool_spec(**picker))
    assert builders.runs_own_picker(deployment, options) is own
    objects = by_key(builders.build(deployment, options))
    assert objects["InferencePool", "m-engine"]["spec"]["endpointPickerRef"]["name"] == service
    picker_kinds = {k for k, name in objects if name == "m-epp"}
    assert picker_kinds == ({"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}
                            if own else set())  # fmt: skip


def test_no_pool_no_picker_and_no_crds_no_picker() -> None:
    assert not any(o["metadata"]["name"] == "m-epp" for o in builders.build(llmd(), WITH_CRDS))
    without_crds = builders.Options(owner_uid="u-1")
    assert not any(
        o["metadata"]["name"] == "m-epp" for o in builders.build(llmd(POOL), without_crds)
    )


def test_the_picker_serves_its_pool_and_reads_its_namespace_only() -> None:
    options = builders.Options(
        owner_uid="u-1", inference_pool=True,
        picker=builders.PickerOptions(image="reg/kubellm:9", fallback_forwarder="gw.sys.svc:80"),
    )  # fmt: skip
    objects = by_key(builders.build(llmd(pool_spec(port=9002, replicas=3)), options))
    deployment = objects["Deployment", "m-epp"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "reg/kubellm:9"
    assert container["command"] == [
        "kubellm", "epp", "--host=0.0.0.0", "--grpc-port=9002", "--grpc-health-port=9003",
        "--metrics-port=9090", "--namespace=ns", "--pool-name=m-engine", "--pool-namespace=ns",
        "--fallback-forwarder=gw.sys.svc:80",
    ]  # fmt: skip
    assert deployment["spec"]["replicas"] == 3
    assert contracts.inference_pool_name("m") == "m-engine"  # what --pool-name must match
    role = objects["Role", "m-epp"]
    assert role["metadata"]["namespace"] == "ns"
    grants = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
              for r in rule["resources"] for v in rule["verbs"]}  # fmt: skip
    assert grants == {
        ("kubellm.io", "llmdeployments", "list"), ("kubellm.io", "llmdeployments", "watch"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "watch"),
    }  # fmt: skip
    assert not any(o["kind"].startswith("Cluster") for o in objects.values())
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    engine = objects["Service", "m-engine"]["spec"]["selector"]
    assert objects["Service", "m-epp"]["spec"]["selector"].items() <= pod_labels.items()
    assert not engine.items() <= pod_labels.items()  # no engine Service selects a picker
    assert contracts.DEPLOYMENT_LABEL not in pod_labels
    for name, obj in objects.items():  # every child labelled for the operator's watch
        assert obj["metadata"]["labels"][contracts.DEPLOYMENT_LABEL] == "m", name


@pytest.mark.parametrize(("port", "health", "metrics"),
                         [(9002, 9003, 9090), (9003, 9004, 9090), (9090, 9003, 9091)])  # fmt: skip
def test_the_pickers_side_ports_never_meet_its_grpc_port(port, health, metrics) -> None:
    objects = by_key(builders.build(llmd(pool_spec(port=port)), WITH_CRDS))
    ports = {p["name"]: p["port"] for p in objects["Service", "m-epp"]["spec"]["ports"]}
    assert ports == {"grpc": port, "grpc-health": health, "metrics": metrics}
    (container,) = objects["Deployment", "m-epp"]["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["grpc"]["port"] == health


TENANTS_POOL = pool_spec(tenantsSecretRef={"name": "team-tenants", "key": "file"})


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("spec", [POOL, TENANTS_POOL], ids=["plain", "tenants"])
def test_the_picker_passes_the_kubernetes_schema(version: str, spec: dict[str, Any]) -> None:
    options = builders.Options(
        owner_uid="u-1", inference_pool=True, http_route=True, tenants_checksum="ab" * 32
    )
    for obj in builders.build(llmd(spec), options):
        if obj["kind"] not in ("InferencePool", "HTTPRoute"):  # those: tests/helm's CRDs
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_picker_reads_the_tenants_file_of_its_namespaces_secret() -> None:
    """tenantsSecretRef: the Secret's key mounted read-only as tenants.yaml, named by a
    `--tenants` that `kubellm epp` accepts, the quota store beside it, the file's checksum
    on the pods; without the ref none of it."""
    from kubellm import cli

    options = builders.Options(
        owner_uid="u-1", inference_pool=True, tenants_checksum="c0ffee",
        picker=builders.PickerOptions(quota_redis="redis://r:6379/0"),
    )  # fmt: skip
    template = by_key(builders.build(llmd(TENANTS_POOL), options))["Deployment", "m-epp"]
    template = template["spec"]["template"]
    (container,) = template["spec"]["containers"]
    args = cli.build_parser().parse_args(container["command"][1:])
    assert (args.command, args.tenants, args.quota_redis) == (
        "epp", "/etc/kubellm/tenants/tenants.yaml", "redis://r:6379/0",
    )  # fmt: skip
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tenants"]
    assert mount == {"name": "tenants", "mountPath": "/etc/kubellm/tenants", "readOnly": True}
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "tenants"]
    assert volume["secret"] == {
        "secretName": "team-tenants", "items": [{"key": "file", "path": "tenants.yaml"}],
    }  # fmt: skip
    assert template["metadata"]["annotations"]["checksum/tenants"] == "c0ffee"

    plain = by_key(builders.build(llmd(POOL), options))["Deployment", "m-epp"]["spec"]["template"]
    (container,) = plain["spec"]["containers"]
    assert not any(a.startswith(("--tenants", "--quota-redis")) for a in container["command"])
    assert "checksum/tenants" not in plain["metadata"]["annotations"]
    assert {v["name"] for v in plain["spec"]["volumes"]} == {"tmp"}


def test_a_named_picker_takes_no_tenants_secret() -> None:
    """The CRD's rule: a picker named by `name` is not the operator's, so it cannot be
    given a tenants Secret (it reads its own file)."""
    from kubellm import api

    own = api.EndpointPicker.model_validate({"tenantsSecretRef": {"name": "t"}})
    assert (own.tenants_secret_ref.name, own.tenants_secret_ref.key) == ("t", "tenants.yaml")
    with pytest.raises(ValueError, match="operator's own picker"):
        api.EndpointPicker.model_validate({"name": "x", "tenantsSecretRef": {"name": "t"}})


@pytest.mark.parametrize(
    ("seconds", "duration"),
    [(600, "10m"), (2.5, "2s500ms"), (86400, "24h"), (90, "1m30s"), (3661.5, "1h1m1s500ms"),
     (0.0004, "1ms"), (1.0001, "1s1ms"), (99999.999, "27h46m39s999ms")],
)  # fmt: skip
def test_gateway_durations(seconds: float, duration: str) -> None:
    assert builders.gateway_duration(seconds) == duration


@pytest.mark.parametrize(
    ("timeouts", "bound"),
    [({}, "10m"), ({"totalSeconds": 120}, "2m"), ({"totalSeconds": 0.25}, "250ms"),
     ({"firstByteSeconds": 5}, "10m")],
)  # fmt: skip
def test_the_routes_request_timeout_is_the_whole_requests_bound(timeouts, bound) -> None:
    spec = {**POOL, "routing": {**POOL["routing"], "timeouts": timeouts}}
    route = by_key(builders.build(llmd(spec), WITH_CRDS))["HTTPRoute", "m-engine"]
    assert route["spec"]["rules"][0]["timeouts"] == {"request": bound}


def test_the_default_request_timeout_is_the_gateways() -> None:
    assert GatewaySettings().total_timeout == contracts.DEFAULT_TOTAL_SECONDS
