"""Table tests of the pure builders, and every built object against Kubernetes' schemas."""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubellm.operator import builders

from kubellm import manifests, sources

from .conftest import ROOT

# Oldest and newest Kubernetes minor versions kubellm supports.
KUBERNETES_VERSIONS = ("1.30", "1.34")

BASE: dict[str, Any] = {
    "apiVersion": "kubellm.io/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "m", "namespace": "ns"},
    "spec": {"model": {"source": "hf://org/model"}},
}


def llmd(spec: dict[str, Any] | None = None, **metadata: Any):
    document = copy.deepcopy(BASE)
    document["spec"].update(spec or {})
    document["metadata"].update(metadata)
    return manifests.parse(document)


def example(name: str):
    return next(manifests.load(ROOT / "examples" / name))


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def volume(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    pod = deployment["spec"]["template"]["spec"]
    return next(v for v in pod["volumes"] if v["name"] == name)


VARIANTS = {
    "gpu-example": lambda: example("llama-3.1-8b-gpu.yaml"),
    "cpu-example": lambda: example("tiny-cpu.yaml"),
    "pvc-source": lambda: llmd({"model": {"source": "pvc://weights/llama/8b"}}),
    "file-source": lambda: llmd({"model": {"source": "file:///opt/models/tiny"}}),
    "tensor-parallel": lambda: llmd(
        {"engine": {"tensorParallelSize": 4}, "resources": {"gpu": {"count": 4}}}
    ),
    "amd-gpus-affinity": lambda: llmd(
        {
            "resources": {"gpu": {"count": 2, "resourceName": "amd.com/gpu"}, "memory": "32Gi"},
            "scheduling": {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "gpu", "operator": "In", "values": ["mi300"]}
                                    ]
                                }
                            ]
                        }
                    }
                }
            },
        }
    ),
    "no-grace": lambda: llmd({"terminationGracePeriodSeconds": 0}),
    "rollout-override": lambda: llmd(
        {"replicas": 4, "rollout": {"maxSurge": "25%", "maxUnavailable": 1}},
    ),
}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_object_passes_the_kubernetes_schema(variant, version):
    objects = builders.build(VARIANTS[variant](), builders.Options(owner_uid="u-1"))
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_invalid_object_fails_the_schema_check():
    """The schema check itself bites: a misspelt field is rejected."""
    deployment = builders.engine_deployment(llmd())
    container(deployment)["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_render_example_objects_are_valid_yaml(capsys):
    from argparse import ArgumentParser

    from kubellm.operator import render

    parser = ArgumentParser()
    render.configure(parser)
    args = parser.parse_args(["-f", str(ROOT / "examples" / "llama-3.1-8b-gpu.yaml")])
    assert render.run(args) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in documents] == [
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    ]
    for document in documents:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(document, version, strict=True)


def test_render_reports_a_bad_manifest(tmp_path, capsys):
    from argparse import ArgumentParser

    from kubellm.operator import render

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**BASE, "spec": {"model": {"source": "ftp://x"}}}))
    parser = ArgumentParser()
    render.configure(parser)
    assert render.run(parser.parse_args(["-f", str(bad)])) == 1
    assert "spec.model.source" in capsys.readouterr().err


# --------------------------------------------------------------------------- the engine contract


def test_engine_command_and_spec_mount_follow_the_launcher_contract():
    deployment = builders.engine_deployment(llmd({"engine": {"port": 9000}}))
    engine = container(deployment)
    assert engine["command"] == [
        "kubellm",
        "engine",
        "--spec",
        sources.SPEC_PATH,
        "--port",
        "9000",
        "--host",
        "0.0.0.0",
    ]
    assert engine["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    assert mounts["engine-spec"]["mountPath"] == sources.SPEC_DIR
    assert volume(deployment, "engine-spec")["configMap"]["name"] == "m-engine-spec"
    assert mounts["model"]["mountPath"] == sources.MODEL_ROOT
    assert volume(deployment, "dshm")["emptyDir"] == {"medium": "Memory"}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"


def test_engine_spec_configmap_is_a_valid_llmdeployment():
    source = llmd({"engine": {"maxModelLen": 4096}, "replicas": 3})
    configmap = builders.spec_configmap(source)
    document = json.loads(configmap["data"][sources.SPEC_FILENAME])
    parsed = manifests.parse(document)
    assert parsed.metadata.name == "m" and parsed.metadata.namespace == "ns"
    assert parsed.spec.engine == source.spec.engine
    assert parsed.spec.model == source.spec.model
    assert parsed.spec.resources == source.spec.resources


@pytest.mark.parametrize(
    ("source", "expected_volume", "hf_home"),
    [
        (
            "pvc://weights/llama/8b",
            {"name": "model", "persistentVolumeClaim": {"claimName": "weights"}},
            False,
        ),
        ("hf://org/model@main", {"name": "model", "emptyDir": {}}, True),
        ("file:///opt/models/x", {"name": "model", "emptyDir": {}}, False),
    ],
)
def test_model_volume_follows_the_source(source, expected_volume, hf_home):
    deployment = builders.engine_deployment(llmd({"model": {"source": source}}))
    assert volume(deployment, "model") == expected_volume
    env = {e["name"]: e["value"] for e in container(deployment)["env"]}
    assert (env.get("HF_HOME") == sources.HF_CACHE_DIR) is hf_home


@pytest.mark.parametrize(
    ("gpu", "expected_limits"),
    [
        ({"count": 1}, {"nvidia.com/gpu": "1"}),
        ({"count": 8, "resourceName": "amd.com/gpu"}, {"amd.com/gpu": "8"}),
        ({"count": 0}, {}),
    ],
)
def test_gpu_limits_use_the_configured_resource_name(gpu, expected_limits):
    resources = container(
        builders.engine_deployment(llmd({"resources": {"gpu": gpu, "cpu": "4"}}))
    )["resources"]
    assert resources.get("limits", {}) == expected_limits
    assert resources["requests"] == {"cpu": "4", **expected_limits}


def test_scheduling_is_copied_to_the_pod():
    scheduling = {
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {}},
        "priorityClassName": "llm",
    }
    pod = builders.engine_deployment(llmd({"scheduling": scheduling}))["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == scheduling["nodeSelector"]
    assert pod["tolerations"] == scheduling["tolerations"]
    assert pod["affinity"] == scheduling["affinity"]
    assert pod["priorityClassName"] == "llm"


def test_pods_meet_the_restricted_pod_security_profile():
    deployment = builders.engine_deployment(llmd())
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    ctx = container(deployment)["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["runAsNonRoot"] is True
    assert pod["enableServiceLinks"] is False  # VLLM_PORT from a Service named vllm breaks vLLM


def test_probes_check_health_on_the_named_port_and_allow_slow_loads():
    engine = container(builders.engine_deployment(llmd()))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60


@pytest.mark.parametrize(("grace", "delay"), [(120, 15), (180, 15), (20, 5), (3, 0), (0, 0)])
def test_drain_hook_leaves_most_of_the_grace_period_to_in_flight_requests(grace, delay):
    deployment = builders.engine_deployment(llmd({"terminationGracePeriodSeconds": grace}))
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace
    lifecycle = container(deployment).get("lifecycle")
    if delay:
        assert lifecycle == {"preStop": {"sleep": {"seconds": delay}}}
        assert delay <= grace / 4
    else:
        assert lifecycle is None


def test_rolling_update_never_drops_below_the_ready_replicas_by_default():
    strategy = builders.engine_deployment(llmd())["spec"]["strategy"]
    assert strategy == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    overridden = builders.engine_deployment(VARIANTS["rollout-override"]())["spec"]["strategy"]
    assert overridden["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 1}


def test_replicas_come_from_the_spec():
    assert builders.engine_deployment(llmd({"replicas": 5}))["spec"]["replicas"] == 5


def test_every_child_carries_the_labels_and_the_owner_reference():
    source = llmd({"replicas": 2})
    objects = builders.build(source, builders.Options(owner_uid="u-9", podmonitor=True))
    assert [o["kind"] for o in objects] == [
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "PodMonitor",
    ]
    for obj in objects:
        # the Deployment also says which revision its pod template runs
        revision = {"kubellm.io/revision": builders.spec_hash(source)}
        assert obj["metadata"]["labels"] == {
            "app.kubernetes.io/name": "kubellm-engine",
            "app.kubernetes.io/instance": "m",
            "app.kubernetes.io/component": "engine",
            "app.kubernetes.io/managed-by": "kubellm-operator",
            "app.kubernetes.io/part-of": "kubellm",
            "kubellm.io/deployment": "m",
            **(revision if obj["kind"] == "Deployment" else {}),
        }
        assert obj["metadata"]["namespace"] == "ns"
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "kubellm.io/v1alpha1",
            "kind": "LLMDeployment",
            "name": "m",
            "uid": "u-9",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    assert all("ownerReferences" not in o["metadata"] for o in builders.build(source))


def test_service_exposes_the_engine_port_and_selects_the_engine_pods():
    source = llmd({"engine": {"port": 8080}})
    service = builders.engine_service(source)
    assert service["metadata"]["name"] == "m-engine"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]
    pod_labels = builders.engine_deployment(source)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    selector = dict(part.split("=") for part in builders.selector_string(source).split(","))
    assert selector == service["spec"]["selector"]


def test_pods_are_annotated_for_prometheus_scraping():
    annotations = builders.engine_deployment(llmd())["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize(
    ("spec", "wanted"),
    [
        ({"replicas": 1}, False),
        ({"replicas": 2}, True),
        ({"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}}, True),
        ({"replicas": 1, "autoscaling": {"enabled": False, "maxReplicas": 3}}, False),
    ],
)
def test_disruption_budget_only_when_more_than_one_replica_is_possible(spec, wanted):
    kinds = [o["kind"] for o in builders.build(llmd(spec))]
    assert ("PodDisruptionBudget" in kinds) is wanted


def _hash(spec: dict[str, Any]) -> str:
    return builders.engine_deployment(llmd(spec))["spec"]["template"]["metadata"]["annotations"][
        builders.SPEC_HASH_ANNOTATION
    ]


def test_spec_hash_changes_with_the_engine_but_not_with_scaling_or_routing():
    base = _hash({})
    assert _hash({"engine": {"maxModelLen": 2048}}) != base
    assert _hash({"model": {"source": "hf://org/other"}}) != base
    assert _hash({"replicas": 7}) == base
    assert _hash({"routing": {"policy": "round-robin"}}) == base
    assert _hash({"autoscaling": {"maxReplicas": 9}}) == base


@pytest.mark.parametrize(
    ("spec", "reason", "field"),
    [
        ({"model": {"source": "s3://bucket/model"}}, "UnsupportedModelSource", "spec.model.source"),
        (
            {"engine": {"extraArgs": ["--port=9"]}},
            "InvalidEngineArguments",
            "spec.engine.extraArgs",
        ),
        ({"engine": {"extraArgs": ["--model", "x"]}}, "InvalidEngineArguments", "--model"),
        (
            {
                "engine": {"tensorParallelSize": 1, "dataParallelSize": 16},
                "resources": {"gpu": {"count": 16}},
            },
            "TooManyRankEndpoints",
            "spec.engine.dataParallelSize",
        ),
        (
            {
                "engine": {"tensorParallelSize": 1, "dataParallelSize": 8},
                "resources": {"gpu": {"count": 8}},
                "routing": {"prefixIndex": "precise"},
            },
            "UnsupportedRankKVEvents",
            "spec.routing.prefixIndex",
        ),
    ],
)
def test_unrealisable_specs_raise_a_spec_error_naming_the_field(spec, reason, field):
    with pytest.raises(builders.SpecError) as error:
        builders.build(llmd(spec))
    assert error.value.reason == reason
    assert field in str(error.value)


def test_harmless_extra_args_pass():
    objects = builders.build(llmd({"engine": {"extraArgs": ["--enforce-eager", "--seed=1"]}}))
    assert objects[1]["kind"] == "Deployment"
