"""Generate the `LLMDeployment` CustomResourceDefinition from the pydantic models.

Pydantic writes JSON Schema (2020-12); Kubernetes wants a *structural*
OpenAPI v3.0 schema. `structural()` bridges the two: references inlined,
`Optional[X]` reduced to `X` (absence is how Kubernetes says "unset"),
numeric exclusive bounds in the OpenAPI 3.0 form, free-form maps marked
`x-kubernetes-preserve-unknown-fields`, titles dropped. Unknown fields are
not declared `additionalProperties: false` (structural schemas forbid it next
to `properties`); the API server prunes or, under kubectl's default strict
field validation, rejects them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from kubellm import api

CRD_NAME = f"{api.PLURAL}.{api.GROUP}"
CRD_FILENAME = f"{CRD_NAME}.yaml"

_DROP = {"title", "additionalProperties"}


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """Turn a pydantic JSON schema (with `$defs`) into a structural OpenAPI v3.0 schema."""
    defs = schema.get("$defs", {})

    def convert(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
            return convert(merged)
        if "anyOf" in node:
            options = [o for o in node["anyOf"] if o.get("type") != "null"]
            if sorted(o.get("type", "") for o in options) == ["integer", "string"]:
                rest = {k: v for k, v in node.items() if k not in ("anyOf", "title")}
                return {**rest, "x-kubernetes-int-or-string": True}
            if len(options) != 1:
                raise ValueError(f"cannot express union in a structural schema: {node}")
            rest = {k: v for k, v in node.items() if k not in ("anyOf", "default")}
            if node.get("default") is not None:
                rest["default"] = node["default"]
            return convert({**options[0], **rest})
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DROP or key == "$defs":
                continue
            if key == "default" and value is None:
                continue
            if key == "properties":
                out[key] = {name: convert(sub) for name, sub in value.items()}
            elif key == "items":
                out[key] = convert(value)
            elif key in ("exclusiveMinimum", "exclusiveMaximum"):
                out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
                out[key] = True
            elif key == "const":
                out["enum"] = [value]
            else:
                out[key] = copy.deepcopy(value)
        additional = node.get("additionalProperties")
        if isinstance(additional, dict) and additional:
            out["additionalProperties"] = convert(additional)
        elif node.get("type") == "object" and "properties" not in node:
            out["x-kubernetes-preserve-unknown-fields"] = True
        if not out.get("type") and "enum" not in out and "properties" not in out:
            out["x-kubernetes-preserve-unknown-fields"] = True
            out["type"] = "object"
        if "enum" in out and "type" not in out:
            out["type"] = "string"
        return out

    return convert(schema)


def openapi_schema() -> dict[str, Any]:
    """The `openAPIV3Schema` of the `LLMDeployment` resource."""
    spec = structural(api.LLMDeploymentSpec.model_json_schema(by_alias=True, mode="validation"))
    spec["description"] = "Desired state: the model, how vLLM runs it, scaling, routing, SLOs."
    status = structural(api.LLMDeploymentStatus.model_json_schema(by_alias=True))
    status["description"] = "Observed state, written by the kubellm operator and autoscaler."
    return {
        "type": "object",
        "description": "LLMDeployment runs an open model on vLLM replicas behind the kubellm "
        "gateway.",
        "required": ["spec"],
        "x-kubernetes-validations": [r.to_k8s() for r in api.ROOT_RULES],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {
        "name": "Prefill",
        "type": "integer",
        "jsonPath": ".spec.prefill.replicas",
        "description": "Desired prefill replicas (spec.prefill; the columns before are decode's).",
    },
    {
        "name": "Prefill-Ready",
        "type": "integer",
        "jsonPath": ".status.prefill.readyReplicas",
        "description": "Ready prefill replicas.",
    },
    {
        "name": "KV-Cache",
        "type": "number",
        "jsonPath": ".status.autoscaler.kvCacheUsage",
        "description": "Mean KV-cache pool occupancy of the replicas (0-1).",
    },
    {
        "name": "Revision",
        "type": "string",
        "jsonPath": ".status.rollout.revision",
        "description": "The spec's engine revision (a hash of the engine identity).",
    },
    {
        "name": "Canary",
        "type": "integer",
        "jsonPath": ".status.rollout.canaryWeight",
        "description": "Percent of requests the canary revision takes during a rollout.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The full CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/part-of": "kubellm"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["kubellm"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def render() -> str:
    """The CRD as the YAML text committed under `crds/`."""
    header = "# Generated by `kubellm crds` from kubellm/api.py. Do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)


def write(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CRD_FILENAME
    path.write_text(render())
    return path
