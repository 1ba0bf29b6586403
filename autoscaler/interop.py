"""HPA and KEDA objects that drive an LLMDeployment's /scale on kubellm's signals.

For platforms that standardise on the Kubernetes HPA (with prometheus-adapter)
or on KEDA, these pure functions turn `spec.autoscaling` into an equivalent
`HorizontalPodAutoscaler` or `ScaledObject`: same targets (waiting requests
per replica, KV-cache usage per replica), same windows, same step bounds.
Run one of them *instead of* the kubellm autoscaler (set
`spec.autoscaling.enabled: false`), never beside it.

    python -m kubellm.autoscaler.interop -f examples/llama-3.1-8b-gpu.yaml hpa
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from kubellm import api, manifests, metrics

DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
PERIOD_SECONDS = 15  # HPA's default sync period; the step bounds hold per period


def _quantity(value: float) -> str:
    """A Kubernetes quantity: integers as is, fractions in milli-units (0.8 -> 800m)."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def _adapter_name(metric: str) -> str:
    """prometheus-adapter exposes `vllm:x` as `vllm_x` (colons are not allowed there)."""
    return metric.replace(":", "_")


def _autoscaling(deployment: api.LLMDeployment) -> api.Autoscaling:
    return deployment.spec.autoscaling or api.Autoscaling()


def behavior(autoscaling: api.Autoscaling) -> dict[str, Any]:
    """HPA `behavior` with the kubellm policy's windows and step bounds."""
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": autoscaling.scale_up_stabilization_seconds,
            "selectPolicy": "Max",
            "policies": [
                {"type": "Pods", "value": 4, "periodSeconds": PERIOD_SECONDS},
                {"type": "Percent", "value": 100, "periodSeconds": PERIOD_SECONDS},
            ],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": autoscaling.scale_down_stabilization_seconds,
            "selectPolicy": "Max",
            "policies": [
                {"type": "Pods", "value": 1, "periodSeconds": PERIOD_SECONDS},
                {"type": "Percent", "value": 50, "periodSeconds": PERIOD_SECONDS},
            ],
        },
    }


def _target_ref(deployment: api.LLMDeployment) -> dict[str, str]:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": deployment.metadata.name}


def hpa(deployment: api.LLMDeployment) -> dict[str, Any]:
    """An autoscaling/v2 HPA on per-pod waiting requests and KV usage (via prometheus-adapter)."""
    autoscaling = _autoscaling(deployment)

    def pods_metric(metric: str, target: float) -> dict[str, Any]:
        return {
            "type": "Pods",
            "pods": {
                "metric": {"name": _adapter_name(metric)},
                "target": {"type": "AverageValue", "averageValue": _quantity(target)},
            },
        }

    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {
            "name": deployment.metadata.name,
            "namespace": deployment.metadata.namespace,
        },
        "spec": {
            "scaleTargetRef": _target_ref(deployment),
            "minReplicas": max(1, autoscaling.min_replicas),  # HPA cannot reach zero
            "maxReplicas": autoscaling.max_replicas,
            "metrics": [
                pods_metric(metrics.NUM_REQUESTS_WAITING, autoscaling.target_queue_depth),
                pods_metric(metrics.KV_CACHE_USAGE, autoscaling.target_kv_cache_usage),
            ],
            "behavior": behavior(autoscaling),
        },
    }


def keda(deployment: api.LLMDeployment, prometheus_url: str = DEFAULT_PROMETHEUS) -> dict[str, Any]:
    """A KEDA ScaledObject with Prometheus triggers, waking from zero on gateway pending."""
    autoscaling = _autoscaling(deployment)
    name, namespace = deployment.metadata.name, deployment.metadata.namespace
    pods = f'namespace="{namespace}",pod=~"{name}-.*"'

    def trigger(query: str, threshold: float, metric_name: str) -> dict[str, Any]:
        return {
            "type": "prometheus",
            "name": metric_name,
            "metricType": "AverageValue",  # the query's value divided by the replicas
            "metadata": {
                "serverAddress": prometheus_url,
                "query": query,
                "threshold": _quantity_text(threshold),
            },
        }

    # Wake-up only: pending requests ask for at most one replica (the gateway floor of one);
    # the engines' own triggers size the fleet once it runs.
    pending = f'clamp_max(sum({metrics.GATEWAY_PENDING}{{model="{deployment.served_name}"}}), 1)'
    wake = trigger(pending, 1, "gateway-pending")
    wake["metadata"]["activationThreshold"] = "0"
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "scaleTargetRef": _target_ref(deployment),
            "pollingInterval": 5,
            "cooldownPeriod": autoscaling.idle_seconds_before_zero,
            "minReplicaCount": 0 if autoscaling.scale_to_zero else max(1, autoscaling.min_replicas),
            "maxReplicaCount": autoscaling.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(autoscaling)}},
            "triggers": [
                trigger(
                    f"sum({metrics.NUM_REQUESTS_WAITING}{{{pods}}})",
                    autoscaling.target_queue_depth,
                    "queue-depth",
                ),
                trigger(
                    f"sum({metrics.KV_CACHE_USAGE}{{{pods}}})",
                    autoscaling.target_kv_cache_usage,
                    "kv-cache-usage",
                ),
                wake,
            ],
        },
    }


def _quantity_text(value: float) -> str:
    """KEDA thresholds are strings of plain numbers."""
    return f"{value:g}"


def render(kind: str, deployment: api.LLMDeployment, prometheus_url: str) -> str:
    obj = hpa(deployment) if kind == "hpa" else keda(deployment, prometheus_url)
    return yaml.safe_dump(obj, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-f", "--filename", required=True, help="an LLMDeployment manifest")
    parser.add_argument("kind", choices=("hpa", "keda"))
    parser.add_argument("--prometheus-url", default=DEFAULT_PROMETHEUS)
    args = parser.parse_args(argv)
    try:
        rendered = [
            render(args.kind, d, args.prometheus_url) for d in manifests.load(args.filename)
        ]
    except manifests.ManifestError as error:
        print(error, file=sys.stderr)
        return 1
    print("---\n".join(rendered), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
