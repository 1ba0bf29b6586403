"""Schemas for the rendered kinds that kubernetes-validate does not know (they come from CRDs).

kubernetes-validate carries only the built-in API's OpenAPI schemas. ServiceMonitor, PodMonitor
and PrometheusRule (Prometheus Operator, monitoring.coreos.com/v1) and HTTPRoute (Gateway API,
gateway.networking.k8s.io/v1) are checked here against the subset of their CRD schemas that the
chart uses, written from those projects' v1 CRDs: field names and types are exact, unknown
fields are rejected, so a misspelt field fails here as it would under kubectl's strict field
validation. Fields the chart does not use are not listed (and so would be rejected: add them
when a template starts using them).
"""

from __future__ import annotations

from typing import Any

import jsonschema

STR = {"type": "string"}
STRMAP = {"type": "object", "additionalProperties": STR}
DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                         "(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}  # fmt: skip


def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": props,
            "required": list(required)}  # fmt: skip


METADATA = _obj(
    {
        "name": {"type": "string", "maxLength": 253, "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
        "namespace": {"type": "string", "maxLength": 63},
        "labels": STRMAP,
        "annotations": STRMAP,
    },
    ("name",),
)
LABEL_SELECTOR = _obj({"matchLabels": STRMAP, "matchExpressions": {"type": "array"}})
NAMESPACE_SELECTOR = _obj(
    {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": STR}}
)
RELABELING = _obj(
    {
        "sourceLabels": {"type": "array", "items": STR},
        "separator": STR,
        "targetLabel": STR,
        "regex": STR,
        "modulus": {"type": "integer"},
        "replacement": STR,
        "action": {"enum": ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop",
                            "labelkeep", "lowercase", "uppercase", "keepequal", "dropequal"]},
    }
)  # fmt: skip
ENDPOINT = _obj(
    {
        "port": STR,
        "path": STR,
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "relabelings": {"type": "array", "items": RELABELING},
        "metricRelabelings": {"type": "array", "items": RELABELING},
    }
)
RULE = {
    **_obj(
        {
            "record": STR,
            "alert": STR,
            "expr": {"type": "string", "minLength": 1},
            "for": DURATION,
            "keep_firing_for": DURATION,
            "labels": STRMAP,
            "annotations": STRMAP,
        },
        ("expr",),
    ),
    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
}
PARENT_REF = _obj(
    {
        "group": STR,
        "kind": STR,
        "namespace": STR,
        "name": {"type": "string", "minLength": 1},
        "sectionName": STR,
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
    },
    ("name",),
)
BACKEND_REF = _obj(
    {
        "group": STR,
        "kind": STR,
        "name": {"type": "string", "minLength": 1},
        "namespace": STR,
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "weight": {"type": "integer", "minimum": 0},
    },
    ("name",),
)
HTTP_MATCH = _obj(
    {
        "path": _obj(
            {"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]}, "value": STR}
        ),
        "headers": {"type": "array"},
        "method": STR,
    }
)


def _kind(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _obj(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _kind(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        _obj(
            {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": NAMESPACE_SELECTOR,
                "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
                "jobLabel": STR,
            },
            ("selector", "endpoints"),
        ),
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _kind(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        _obj(
            {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": NAMESPACE_SELECTOR,
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
                "jobLabel": STR,
            },
            ("selector", "podMetricsEndpoints"),
        ),
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): _kind(
        "monitoring.coreos.com/v1",
        "PrometheusRule",
        _obj(
            {
                "groups": {
                    "type": "array",
                    "items": _obj(
                        {
                            "name": {"type": "string", "minLength": 1},
                            "interval": DURATION,
                            "rules": {"type": "array", "items": RULE},
                        },
                        ("name", "rules"),
                    ),
                }
            },
            ("groups",),
        ),
    ),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): _kind(
        "gateway.networking.k8s.io/v1",
        "HTTPRoute",
        _obj(
            {
                "parentRefs": {"type": "array", "minItems": 1, "items": PARENT_REF},
                "hostnames": {"type": "array", "items": STR},
                "rules": {
                    "type": "array",
                    "items": _obj(
                        {
                            "matches": {"type": "array", "items": HTTP_MATCH},
                            "backendRefs": {"type": "array", "items": BACKEND_REF},
                        }
                    ),
                },
            }
        ),
    ),
}


def validate(obj: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when `obj` breaks its kind's schema; KeyError if unknown."""
    jsonschema.validate(obj, SCHEMAS[(obj["apiVersion"], obj["kind"])])
