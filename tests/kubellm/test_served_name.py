"""spec.model.servedName reaches HTTP headers (the HTTPRoute's model-name match): what a
header value cannot hold is refused, by the models and by the CRD's schema alike."""

from __future__ import annotations

import re

import pydantic
import pytest

from kubellm import api, crd

BAD = ["tenant\nb", "a\r\nx-injected: 1", "nul\x00", "tab\tname", " edge", "edge ", "ünï"]
GOOD = ["m", "org/name-1.5", "llama:8b@rev", "a b"]


def served_name_schema() -> dict:
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["model"]["properties"]["servedName"]


@pytest.mark.parametrize("name", BAD)
def test_a_served_name_a_header_cannot_hold_is_refused(name: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="servedName"):
        api.ModelSpec(source="hf://org/m", servedName=name)
    assert not re.fullmatch(served_name_schema()["pattern"], name)


@pytest.mark.parametrize("name", GOOD)
def test_ordinary_served_names_are_accepted(name: str) -> None:
    assert api.ModelSpec(source="hf://org/m", servedName=name).served_name == name
    assert re.fullmatch(served_name_schema()["pattern"], name)
