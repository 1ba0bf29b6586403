"""Credentials in a URL (`user:password@`) are a configuration error, never a label on the
metrics port or a 500 at request time."""

from __future__ import annotations

import pydantic
import pytest
from kubellm.gateway.discovery import static
from kubellm.gateway.routing.latency import metrics as slo
from prometheus_client import CollectorRegistry, generate_latest

from kubellm import api


def test_a_fallback_url_with_credentials_is_refused_naming_the_field() -> None:
    document = {"models": [{
        "name": "m", "endpoints": ["http://127.0.0.1:8000"],
        "fallback": {"url": "https://user:s3cret@api.example.com/v1", "apiKey": "k"},
    }]}  # fmt: skip
    with pytest.raises(static.StaticConfigError, match=r"fallback\.url must not carry credentials"):
        static.parse(document, env={})
    with pytest.raises(pydantic.ValidationError, match="must not carry credentials") as error:
        api.Fallback.model_validate(
            {"url": "http://u:p@api.example.com", "apiKeySecretRef": {"name": "s", "key": "k"}}
        )
    assert "s3cret" not in str(error.value)


def test_an_endpoint_url_with_credentials_is_refused_naming_the_field() -> None:
    document = {"models": [{"name": "m", "endpoints": ["http://admin:s3cret@127.0.0.1:8000"]}]}
    with pytest.raises(static.StaticConfigError, match="endpoints") as error:
        static.parse(document, env={})
    assert "must not carry credentials" in str(error.value)


def test_an_address_with_an_at_sign_in_its_path_is_fine() -> None:
    document = {"models": [{"name": "m", "endpoints": ["http://127.0.0.1:8000/a@b"]}]}
    assert static.parse(document, env={})["m"].endpoints[0].url == "http://127.0.0.1:8000/a@b"


def test_the_endpoint_label_never_carries_credentials() -> None:
    registry = CollectorRegistry()
    metrics = slo.create(registry)
    url = "http://admin:s3cret@10.0.0.7:8000"
    metrics.publish_endpoints([(("m", "m", "default"), url, "ready")])
    text = generate_latest(registry).decode()
    assert "s3cret" not in text and 'url="http://10.0.0.7:8000"' in text
