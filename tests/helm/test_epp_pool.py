"""The chart's endpoint picker can be told the one InferencePool it serves (epp.poolName),
as the Inference Extension's picker is; the operator names an LLMDeployment's pool as the
picker's `--pool-name` expects it, and by default runs a picker per pool
(operator.endpointPicker.mode perPool), for which the chart grants it what it grants."""

from __future__ import annotations

import pytest
from kubellm.operator import builders

from kubellm import api, contracts
from tests.helm.chart import chart, component, of_kind, render_values
from tests.helm.test_rbac import granted


def epp_args(values: dict) -> list[str]:
    deployments = of_kind(render_values(values), "Deployment")
    (epp,) = [d for d in deployments if d["metadata"]["name"].endswith("-epp")]
    return epp["spec"]["template"]["spec"]["containers"][0]["args"]


def test_pool_name_reaches_the_pickers_command_line() -> None:
    args = epp_args({"epp": {"enabled": True, "poolName": "chat-engine", "poolNamespace": "llm"}})
    assert "--pool-name=chat-engine" in args and "--pool-namespace=llm" in args
    assert not any(a.startswith("--pool") for a in epp_args({"epp": {"enabled": True}}))


@pytest.mark.parametrize("bad", ["Chat", "a b", "x\ny"])
def test_a_pool_name_kubernetes_cannot_hold_is_refused_by_the_schema(bad: str) -> None:
    with pytest.raises(Exception, match="poolName"):
        chart().validate_schema({"epp": {"enabled": True, "poolName": bad}})


def test_the_operators_pool_is_the_one_the_picker_is_told() -> None:
    llmd = api.LLMDeployment.model_validate({
        "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": "chat", "namespace": "llm"},
        "spec": {"model": {"source": "hf://org/m"}, "routing": {"inferencePool": {}}},
    })  # fmt: skip
    pool = builders.inference_pool(llmd, builders.Options(inference_pool=True))
    assert pool["metadata"]["name"] == contracts.inference_pool_name("chat") == "chat-engine"


def operator_args(values: dict) -> list[str]:
    (operator,) = [d for d in of_kind(render_values(values), "Deployment")
                   if component(d) == "operator"]  # fmt: skip
    return operator["spec"]["template"]["spec"]["containers"][0]["args"]


def test_by_default_the_operator_runs_a_picker_per_pool_from_the_charts_image() -> None:
    args = operator_args({})
    assert "--epp-image=ghcr.io/kubellm/kubellm:0.1.0" in args
    assert "--epp-fallback-forwarder=kubellm-gateway.kubellm-system.svc:80" in args
    assert not any(a.startswith("--shared-endpoint-picker") for a in args)
    (resources,) = [a for a in args if a.startswith("--epp-resources=")]
    assert resources.endswith('"requests":{"cpu":"250m","memory":"256Mi"}}')
    no_gateway = operator_args({"gateway": {"enabled": False}})
    assert not any(a.startswith("--epp-fallback-forwarder") for a in no_gateway)


def test_shared_mode_names_the_charts_picker_and_needs_it() -> None:
    args = operator_args({"operator": {"endpointPicker": {"mode": "shared"}},
                          "epp": {"enabled": True}})  # fmt: skip
    assert "--shared-endpoint-picker=kubellm-epp" in args
    assert not any(a.startswith("--epp-image") for a in args)
    with pytest.raises(Exception, match=r"set epp\.enabled=true"):
        render_values({"operator": {"endpointPicker": {"mode": "shared"}}})
    with pytest.raises(Exception, match="mode"):
        chart().validate_schema({"operator": {"endpointPicker": {"mode": "PerPool"}}})


def _rule_grants(rules) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}  # fmt: skip


def test_the_operator_holds_what_a_pools_picker_role_grants() -> None:
    """Kubernetes refuses a Role (or RoleBinding) granting what its writer does not hold
    (RBAC escalation prevention): the operator's grants cover the picker's Role, and it may
    write the picker's account, Role and binding; in shared mode it needs none of these."""
    picker = _rule_grants(builders.PICKER_RULES)
    writes = {(g, r, "patch") for g, r in
              [("", "serviceaccounts"), ("rbac.authorization.k8s.io", "roles"),
               ("rbac.authorization.k8s.io", "rolebindings")]}  # fmt: skip
    default = granted(render_values({}), "operator")
    assert picker | writes <= default
    shared = granted(render_values({"operator": {"endpointPicker": {"mode": "shared"}},
                                    "epp": {"enabled": True}}), "operator")  # fmt: skip
    assert not (writes | {("discovery.k8s.io", "endpointslices", "list")}) & shared


def test_the_pickers_podmonitor_selects_the_operators_pickers_only() -> None:
    """With metrics.serviceMonitor.enabled the per-pool pickers are scraped (the gateway's
    metric names, so the SLO rules cover Gateway traffic): the PodMonitor selects the pods
    the operator builds, and neither the chart's own picker nor an engine."""
    objs = render_values({"metrics": {"serviceMonitor": {"enabled": True}}})
    (monitor,) = [
        o for o in of_kind(objs, "PodMonitor") if o["metadata"]["name"].endswith("-pools")
    ]
    selector = monitor["spec"]["selector"]["matchLabels"]
    llmd = api.LLMDeployment.model_validate({
        "apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": "chat", "namespace": "llm"},
        "spec": {"model": {"source": "hf://org/m"}, "routing": {"inferencePool": {}}},
    })  # fmt: skip
    options = builders.Options(inference_pool=True)
    picker = builders.picker_deployment(llmd, options)["spec"]["template"]["metadata"]["labels"]
    engine = builders.engine_deployment(llmd, options)["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= picker.items() and not selector.items() <= engine.items()
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    shared = render_values({
        "metrics": {"serviceMonitor": {"enabled": True}}, "epp": {"enabled": True},
        "operator": {"endpointPicker": {"mode": "shared"}},
    })  # fmt: skip
    assert not [
        o for o in of_kind(shared, "PodMonitor") if o["metadata"]["name"].endswith("-pools")
    ]
    chart_epp = next(d for d in of_kind(shared, "Deployment") if component(d) == "epp")
    assert not selector.items() <= chart_epp["spec"]["template"]["metadata"]["labels"].items()
