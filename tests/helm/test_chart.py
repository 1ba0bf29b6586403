"""The Helm chart, rendered by the real Helm library: lint, schema, objects, security, CRD bytes."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_python.chart import lint
from helm_python.errors import HelmError

from kubellm import cli, crd, manifests
from tests.helm import crd_kinds
from tests.helm.chart import (
    CHART_DIR,
    NAMESPACE,
    ROOT,
    VALUE_SETS,
    chart,
    component,
    objects,
    of_kind,
    render_values,
    rendered_text,
    values_of,
)

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and a recent one.
KUBE_VERSIONS = ["1.28.0", "1.33.0"]  # 1.28: CEL rules with fieldPath
SETS = list(VALUE_SETS)
COMPONENTS = ("operator", "gateway", "autoscaler")


# --------------------------------------------------------------------------- helm lint, schema


@pytest.mark.parametrize("value_set", SETS)
def test_helm_lint_passes(value_set: str) -> None:
    report = lint(CHART_DIR, values_of(value_set), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def test_chart_metadata() -> None:
    meta = chart().metadata
    assert meta["name"] == "kubellm"
    assert meta["appVersion"]
    assert meta["apiVersion"] == "v2"


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"gateway": {"replica": 3}}, "replica"),  # misspelt key, nested
        ({"imagePullPolicy": "Always"}, "imagePullPolicy"),  # misspelt key, top level
        ({"gateway": {"replicas": "three"}}, "replicas"),  # wrong type
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),  # not in the enum
        ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, "interval"),
        ({"autoscaler": {"replicas": 2}}, "replicas"),  # two autoscalers would fight over /scale
    ],
)
def test_values_schema_rejects_bad_values(values: dict, needle: str) -> None:
    with pytest.raises(HelmError, match=needle):
        chart().validate_schema(values)
    with pytest.raises(HelmError):
        chart().render(values, name="kubellm", namespace=NAMESPACE)


@pytest.mark.parametrize("value_set", SETS)
def test_values_schema_accepts_shipped_values(value_set: str) -> None:
    chart().validate_schema(values_of(value_set))


def test_every_default_value_is_documented() -> None:
    """Each key in values.yaml has a comment line above it, or sits inside a documented one."""
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    undocumented = []
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)(?:- )?([A-Za-z_]\w*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        commented = i > 0 and lines[i - 1].strip().startswith("#")
        documented = commented or any(doc for _, doc in stack)
        if not documented and not line.rstrip().endswith(":"):
            undocumented.append(f"{i + 1}: {line.strip()}")
        stack.append((indent, documented))
    assert not undocumented, "values without a comment:\n" + "\n".join(undocumented)


# --------------------------------------------------------------------------- rendered objects


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("value_set", SETS)
def test_every_object_passes_kubernetes_schemas(value_set: str, kube_version: str) -> None:
    checked_builtin = checked_crd_kinds = 0
    for obj in objects(value_set):
        key = (obj["apiVersion"], obj["kind"])
        if key in crd_kinds.SCHEMAS:
            crd_kinds.validate(obj)
            checked_crd_kinds += 1
        else:
            kubernetes_validate.validate(obj, kube_version, strict=True)
            checked_builtin += 1
    assert checked_builtin >= 1
    if value_set == "full-values":
        # 2 ServiceMonitors, 2 PodMonitors (engines, per-pool pickers), PrometheusRule, HTTPRoute
        assert checked_crd_kinds == 6


def test_crd_kind_schemas_reject_a_misspelt_field() -> None:
    monitor = next(o for o in objects("full-values") if o["kind"] == "ServiceMonitor")
    bad = yaml.safe_load(yaml.safe_dump(monitor))
    bad["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        crd_kinds.validate(bad)


@pytest.mark.parametrize("value_set", SETS)
def test_names_fit_in_63_characters_and_are_unique(value_set: str) -> None:
    seen = set()
    for obj in objects(value_set):
        name = obj["metadata"]["name"]
        if obj["kind"] != "CustomResourceDefinition":
            assert len(name) <= 63, name
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
        key = (obj["kind"], obj["metadata"].get("namespace"), name)
        assert key not in seen, key
        seen.add(key)


def test_what_the_default_install_contains() -> None:
    kinds = {}
    for obj in objects("default"):
        kinds.setdefault(obj["kind"], set()).add(component(obj))
    assert kinds["Deployment"] == set(COMPONENTS)
    assert kinds["ServiceAccount"] == set(COMPONENTS)
    assert kinds["ClusterRole"] == set(COMPONENTS)
    assert kinds["PodDisruptionBudget"] == set(COMPONENTS)
    assert kinds["Service"] == {"gateway", "autoscaler"}
    assert "CustomResourceDefinition" in kinds
    for optional in ("Ingress", "HTTPRoute", "ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert optional not in kinds
    assert "ConfigMap" not in kinds


def test_gateway_only_install() -> None:
    objs = objects("gateway-only-values")
    assert {component(o) for o in of_kind(objs, "Deployment")} == {"gateway"}
    assert not of_kind(objs, "CustomResourceDefinition")
    (role,) = of_kind(objs, "ClusterRole")
    assert all("secrets" not in r["resources"] for r in role["rules"])


@pytest.mark.parametrize("value_set", SETS)
def test_pods_meet_the_restricted_pod_security_standard(value_set: str) -> None:
    for deployment in of_kind(objects(value_set), "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        assert not any("hostPath" in v for v in pod.get("volumes", []))
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert not sc.get("privileged")
            assert "add" not in sc["capabilities"]
            assert container["resources"]["requests"]
            assert container["resources"]["limits"]["memory"]
            assert "livenessProbe" in container


@pytest.mark.parametrize("value_set", SETS)
def test_selectors_match_their_pods(value_set: str) -> None:
    objs = objects(value_set)
    pods = {
        component(d): d["spec"]["template"]["metadata"]["labels"]
        for d in of_kind(objs, "Deployment")
    }
    for deployment in of_kind(objs, "Deployment"):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pods[component(deployment)].items()
    for kind, path in (("PodDisruptionBudget", ("selector", "matchLabels")), ("Service", ())):
        for obj in of_kind(objs, kind):
            selector = obj["spec"]["selector"]
            for key in path[1:] if kind == "PodDisruptionBudget" else ():
                selector = selector[key]
            selector = selector.get("matchLabels", selector)
            assert selector.items() <= pods[component(obj)].items(), obj["metadata"]["name"]


def test_image_tag_defaults_to_app_version_and_can_be_set() -> None:
    app_version = chart().metadata["appVersion"]
    for deployment in of_kind(objects("default"), "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["image"] == f"ghcr.io/kubellm/kubellm:{app_version}"
        assert container["args"][0] == component(deployment)
    for deployment in of_kind(objects("full-values"), "Deployment"):
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"].endswith(
            ":0.1.0-rc1"
        )


def test_component_commands() -> None:
    deployments = {component(d): d for d in of_kind(objects("default"), "Deployment")}
    gateway = deployments["gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert "--port=8000" in gateway["args"]
    assert gateway["ports"][0]["containerPort"] == 8000
    assert "--metrics-port=9090" in gateway["args"]  # /metrics off the public listener
    assert gateway["ports"][1] == {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}
    autoscaler = deployments["autoscaler"]["spec"]["template"]["spec"]["containers"][0]
    assert (
        f"--gateway-metrics-url=http://kubellm-gateway-metrics.{NAMESPACE}.svc:9090/metrics"
        in (autoscaler["args"])
    )
    assert "--metrics-port=9090" in autoscaler["args"]
    # one operator and one autoscaler at a time, even during a rollout
    for name in ("operator", "autoscaler"):
        assert deployments[name]["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize("value_set", SETS)
def test_container_args_parse_with_the_components_own_cli(value_set: str) -> None:
    """The chart passes only flags `kubellm <component>` accepts (argparse exits otherwise)."""
    for deployment in of_kind(objects(value_set), "Deployment"):
        name = component(deployment)
        module = cli.COMPONENT_COMMANDS[name][0]
        if importlib.util.find_spec(module) is None:
            continue  # not written yet: nothing to check against
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        args = cli.build_parser().parse_args(container["args"])
        assert args.command == name


def test_long_names_are_cut_to_63() -> None:
    override = values_of("gateway-only-values")["fullnameOverride"]
    assert len(override) > 63
    (deployment,) = of_kind(objects("gateway-only-values"), "Deployment")
    name = deployment["metadata"]["name"]
    assert len(name) == 63 and name.endswith("-gateway"), name
    assert override.startswith(name.removesuffix("-gateway"))


def test_values_schema_is_closed_at_every_level() -> None:
    """Every object with declared properties rejects unknown keys (a misspelling anywhere)."""
    open_objects = []

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                open_objects.append(path or "/")
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")

    walk(chart().schema, "")
    assert not open_objects, open_objects


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads((CHART_DIR / "files" / "dashboards" / "kubellm-slo.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "deployment"} <= variables
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert [r.get("repeat") for r in rows] == ["tenant"]  # a row per tenant
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        tenant_row = "(tenant $tenant)" in panel["title"]
        # every query is scoped to the selected deployment, or to the row's tenant
        scope = 'tenant="$tenant"' if tenant_row else 'deployment="$deployment"'
        for target in panel["targets"]:
            assert scope in target["expr"], (panel["title"], target["expr"])


def test_httproute_without_parents_is_refused() -> None:
    with pytest.raises(HelmError, match="parentRefs"):
        render_values({"gateway": {"httpRoute": {"enabled": True}}})


def test_secret_reads_can_be_scoped_to_namespaces() -> None:
    objs = objects("full-values")
    roles = of_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    gateway_role = next(r for r in of_kind(objs, "ClusterRole") if component(r) == "gateway")
    assert all("secrets" not in rule["resources"] for rule in gateway_role["rules"])


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar() -> None:
    (cm,) = of_kind(objects("full-values"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    (body,) = cm["data"].values()
    source = (CHART_DIR / "files" / "dashboards" / "kubellm-slo.json").read_text()
    assert yaml.safe_load(body) == yaml.safe_load(source)


# --------------------------------------------------------------------------- the CRD


def test_chart_carries_the_generated_crd_bytes() -> None:
    """files/crds/ links to crds/: Helm loads (and `helm package` embeds) the generated bytes."""
    generated = ROOT / "crds" / crd.CRD_FILENAME
    (shipped,) = [f for f in chart().files if f["name"] == f"files/crds/{crd.CRD_FILENAME}"]
    assert shipped["data"].encode() == generated.read_bytes()
    assert generated.read_text() == crd.render(), "crds/ is stale: run `kubellm crds`"


def test_rendered_crd_is_the_generated_one_kept_on_uninstall() -> None:
    (rendered,) = of_kind(objects("default"), "CustomResourceDefinition")
    annotations = rendered["metadata"].pop("annotations")
    assert annotations == {"helm.sh/resource-policy": "keep"}
    assert rendered == yaml.safe_load((ROOT / "crds" / crd.CRD_FILENAME).read_text())
    (unkept,) = of_kind(render_values({"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "annotations" not in unkept["metadata"]


# --------------------------------------------------------------------------- NOTES.txt


def _notes(value_set: str) -> str:
    (text,) = [t for p, t in rendered_text(value_set).items() if p.endswith("NOTES.txt")]
    return text


def test_notes_example_is_a_valid_llmdeployment(tmp_path: Path) -> None:
    notes = _notes("default")
    block = re.search(r"cat <<'YAML' \| kubectl apply -f -\n(.*?)\n\s*YAML\n", notes, re.S)
    assert block, notes
    example = tmp_path / "example.yaml"
    example.write_text(block.group(1))
    (deployment,) = manifests.load(example)
    assert deployment.spec.model.served_name == "tiny"
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in notes
    assert "port-forward svc/kubellm-gateway 8000:80" in notes
    assert f"http://kubellm-gateway.{NAMESPACE}.svc:80/v1" in notes


def test_notes_tell_how_to_install_the_crd_when_the_chart_does_not() -> None:
    assert "kubectl apply --server-side -f" in _notes("gateway-only-values")
    assert "kubectl apply --server-side -f" not in _notes("default")
