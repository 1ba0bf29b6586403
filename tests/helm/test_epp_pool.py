"""The chart's endpoint picker can be told the one InferencePool it serves (epp.poolName),
as the Inference Extension's picker is; the operator names an LLMDeployment's pool as the
picker's `--pool-name` expects it."""

from __future__ import annotations

import pytest
from kubellm.operator import builders

from kubellm import api, contracts
from tests.helm.chart import chart, of_kind, render_values


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
