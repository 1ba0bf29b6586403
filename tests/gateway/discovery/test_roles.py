"""Endpoints carry their P/D role (contracts.ROLE_LABEL); a whole request goes to decode and
unlabelled replicas only; a model with spec.prefill carries its split settings."""

from __future__ import annotations

import pytest
from kubellm.gateway.discovery import kubernetes as k8s
from kubellm.gateway.discovery.base import PrefillSplit
from kubellm.gateway.discovery.static import StaticConfigError, parse

from kubellm.capacity import KV_LINK_GBPS
from kubellm.contracts import ROLE_LABEL

from .test_discovery import _llmd, _slice


def _role_slice(owner: str, address: str, role: str | None) -> dict:
    s = _slice(owner, [(address, {"ready": True})])
    if role is not None:
        s["metadata"]["labels"][ROLE_LABEL] = role
    return s


def test_slices_label_their_endpoints_role_and_prefill_replicas_take_no_whole_request():
    item = _llmd(
        "llama",
        prefill={"replicas": 1, "kvConnector": {"linkBandwidthGBps": 20}},
        model={"source": "hf://org/m",
               "architecture": {"paramsBillions": 8, "numLayers": 32, "numKVHeads": 8,
                                "headDim": 128}},
    )  # fmt: skip
    slices = [
        _role_slice("llama", "10.0.0.1", "prefill"),
        _role_slice("llama", "10.0.0.2", "decode"),
        _role_slice("llama", "10.0.0.3", None),
        _role_slice("llama", "10.0.0.4", "other"),  # unknown role: serves both phases
    ]
    target = k8s.build_targets(k8s.parse_deployments([item]), slices, {})["llama"]
    roles = {e.url: e.role for e in target.endpoints}
    assert roles == {"http://10.0.0.1:8000": "prefill", "http://10.0.0.2:8000": "decode",
                     "http://10.0.0.3:8000": None, "http://10.0.0.4:8000": None}  # fmt: skip
    assert [e.url for e in target.routable] == [
        "http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://10.0.0.4:8000",
    ]  # fmt: skip
    assert [e.url for e in target.prefill_endpoints] == ["http://10.0.0.1:8000"]
    assert target.prefill == PrefillSplit("Conditional", 2 * 32 * 8 * 128 * 2, 20e9)


def test_a_deployment_without_prefill_is_aggregated():
    target = k8s.build_targets(k8s.parse_deployments([_llmd("a")]), [], {})["a"]
    assert target.prefill is None and target.prefill_endpoints == ()


def test_static_endpoints_carry_a_role_and_the_model_its_split():
    models = parse({"models": [{
        "name": "m",
        "prefill": {"split": "Always", "kvBytesPerToken": 1000},
        "endpoints": [{"url": "http://p", "role": "prefill"}, {"url": "http://d", "role": "decode"},
                      "http://both"],
    }]})  # fmt: skip
    m = models["m"]
    assert [e.url for e in m.routable] == ["http://d", "http://both"]
    assert [e.url for e in m.prefill_endpoints] == ["http://p"]
    assert m.prefill == PrefillSplit("Always", 1000, KV_LINK_GBPS["rdma"] * 1e9)
    with pytest.raises(StaticConfigError, match="role"):
        parse({"models": [{"name": "m", "endpoints": [{"url": "http://p", "role": "both"}]}]})
    with pytest.raises(StaticConfigError, match="linkBandwidthGBps"):
        parse({"models": [{"name": "m", "prefill": {"linkBandwidthGBps": 0}}]})
