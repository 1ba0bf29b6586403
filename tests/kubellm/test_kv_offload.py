"""spec.engine.kvOffload: the API's bounds, vLLM's flags (read back by vLLM's own parser),
the pod's memory request and disk volume, and each tier's capacity in tokens."""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import sys
from typing import Any

import kubernetes_validate
import pytest
from kubellm.operator import builders

from kubellm import capacity, kv_tiers, manifests

BASE: dict[str, Any] = {
    "apiVersion": "kubellm.io/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "m", "namespace": "ns"},
    "spec": {
        "model": {
            "source": "hf://org/model",
            "architecture": {
                "numLayers": 32, "numKVHeads": 8, "headDim": 128, "paramsBillions": 8,
            },
        },
        "engine": {"maxModelLen": 32768},
        "resources": {"gpu": {"memoryGiB": 80, "bandwidthGBps": 3350}},
    },
}  # fmt: skip


def llmd(engine: dict[str, Any] | None = None, **spec: Any):
    document = copy.deepcopy(BASE)
    document["spec"]["engine"].update(engine or {})
    document["spec"].update(spec)
    return manifests.parse(document)


@pytest.mark.parametrize(
    ("offload", "field"),
    [
        ({"hostGiB": 0}, "hostGiB"),
        ({"hostGiB": -1}, "hostGiB"),
        ({"hostGiB": 10**6}, "hostGiB"),
        ({}, "hostGiB"),
        ({"hostGiB": 64, "disk": {"sizeGiB": 0}}, "sizeGiB"),
        ({"hostGiB": 64, "disk": {"sizeGiB": 100, "claimName": ""}}, "claimName"),
        ({"hostGiB": 64, "disk": {"sizeGiB": 100, "bogus": 1}}, "bogus"),
    ],
)
def test_bad_offload_specs_are_refused_naming_the_field(offload, field) -> None:
    with pytest.raises(manifests.ManifestError, match=field):
        llmd({"kvOffload": offload})


def test_offload_needs_prefix_caching() -> None:
    with pytest.raises(manifests.ManifestError, match=r"kvOffload needs spec\.engine\.prefix"):
        llmd({"kvOffload": {"hostGiB": 64}, "prefixCaching": False})


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM's own parser is the reference"
)


@pytest.fixture(scope="module")
def vllm_parser(tmp_path_factory: pytest.TempPathFactory):
    from kubellm.engine import launcher

    if launcher.torchcodec_broken():
        sys.path.insert(0, launcher.write_torchcodec_shim(tmp_path_factory.mktemp("shim")))
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def engine_args(parser, target) -> Any:
    from kubellm.engine import launcher
    from vllm.engine.arg_utils import AsyncEngineArgs

    argv = launcher.build_command(target).argv
    return AsyncEngineArgs.from_cli_args(parser.parse_args(argv[3:]))


def target(offload: dict[str, Any] | None, prefix_index: str = "approximate"):
    from kubellm.engine import launcher

    document = copy.deepcopy(BASE)["spec"]
    if offload is not None:
        document["engine"]["kvOffload"] = offload
    document["routing"] = {"prefixIndex": prefix_index}
    return launcher.parse_target(document)


@needs_vllm
def test_vllm_reads_the_host_tier_as_its_native_cpu_offload(vllm_parser) -> None:
    args = engine_args(vllm_parser, target({"hostGiB": 96.5}))
    assert (args.kv_offloading_backend, args.kv_offloading_size) == ("native", 96.5)
    assert args.kv_transfer_config is None
    args = engine_args(vllm_parser, target(None))
    assert args.kv_offloading_size is None


@needs_vllm
@pytest.mark.parametrize("prefix_index", ["approximate", "precise"])
def test_vllm_reads_the_disk_tier_as_a_file_system_secondary_tier(
    vllm_parser, prefix_index
) -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    offload = {"hostGiB": 64, "disk": {"sizeGiB": 500}}
    args = engine_args(vllm_parser, target(offload, prefix_index))
    assert (args.kv_offloading_backend, args.kv_offloading_size) == ("native", 64)
    config = args.kv_transfer_config
    assert (config.kv_connector, config.kv_role) == ("OffloadingConnector", "kv_both")
    extra = config.kv_connector_extra_config
    spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
    assert spec_cls.__name__ == "TieringOffloadingSpec"
    (tier,) = extra["secondary_tiers"]
    tier_cls = SecondaryTierFactory.get_tier_class(tier)
    assert tier_cls.__name__ == "FileSystemTierManager"
    # every key the tier gets is one its constructor takes (what create_secondary_tier passes)
    params = {k: v for k, v in tier.items() if k != "type"}
    inspect.signature(tier_cls.__init__).bind(
        None, offloading_spec=None, primary_kv_view=None, tier_type="fs", **params
    )
    assert tier["root_dir"] == kv_tiers.DISK_DIR
    assert tier.get("enable_kv_events", False) is (prefix_index == "precise")


def resources(deployment: Any) -> dict[str, Any]:
    """The engine container's resources in the workload the operator renders (the worker's,
    where a replica spans pods: each pod pins its part)."""
    spec = builders.engine_workload(deployment)["spec"]
    template = spec.get("template") or spec["leaderWorkerTemplate"]["workerTemplate"]
    (engine,) = [c for c in template["spec"]["containers"] if c["name"] == "engine"]
    return engine["resources"]


def test_pod_memory_request_grows_with_the_host_tier() -> None:
    plain = llmd(resources={"memory": "32Gi", "gpu": {"memoryGiB": 80}})
    assert resources(plain)["requests"]["memory"] == "32Gi"
    tiered = llmd({"kvOffload": {"hostGiB": 96}}, resources={"memory": "32Gi"})
    assert resources(tiered)["requests"]["memory"] == f"{128 * 1024}Mi"
    assert resources(tiered)["limits"]["memory"] == f"{128 * 1024}Mi"
    # no memory set: the tier is requested (the scheduler reserves it), no limit is invented
    bare = llmd({"kvOffload": {"hostGiB": 96}})
    assert resources(bare)["requests"]["memory"] == f"{96 * 1024}Mi"
    assert "memory" not in resources(bare).get("limits", {})
    # a replica over two nodes: each pod pins its half
    wide = llmd(
        {"kvOffload": {"hostGiB": 96}, "pipelineParallelSize": 2},
        resources={"memory": "1Gi", "nodes": 2},
    )
    assert resources(wide)["requests"]["memory"] == f"{1024 + 48 * 1024}Mi"


@pytest.mark.parametrize(
    ("disk", "expected"),
    [
        ({"sizeGiB": 500}, {"emptyDir": {"sizeLimit": f"{500 * 1024}Mi"}}),
        ({"sizeGiB": 2000, "claimName": "nvme"}, {"persistentVolumeClaim": {"claimName": "nvme"}}),
    ],
)
def test_disk_tier_is_a_mounted_volume(disk, expected) -> None:
    deployment = builders.engine_deployment(llmd({"kvOffload": {"hostGiB": 8, "disk": disk}}))
    pod = deployment["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "kv-offload")
    assert volume == {"name": "kv-offload", **expected}
    (engine,) = pod["containers"]
    assert {"name": "kv-offload", "mountPath": kv_tiers.DISK_DIR} in engine["volumeMounts"]
    kubernetes_validate.validate(deployment, "1.34", strict=True)
    plain = builders.engine_deployment(llmd())["spec"]["template"]["spec"]
    assert all(v["name"] != "kv-offload" for v in plain["volumes"])


def test_status_capacity_gives_each_tiers_tokens() -> None:
    plain = capacity.for_spec(llmd().spec)
    assert "kvTokensHost" not in plain
    out = capacity.for_spec(llmd({"kvOffload": {"hostGiB": 64, "disk": {"sizeGiB": 512}}}).spec)
    per_token = out["kvBytesPerToken"]
    assert per_token == 2 * 32 * 8 * 128 * 2
    assert out["kvTokensGPU"] == out["kvPoolBytes"] // per_token
    assert out["kvTokensHost"] == 64 * 2**30 // per_token == 524_288
    assert out["kvTokensDisk"] == 512 * 2**30 // per_token
    assert json.dumps(out)  # status is JSON


def test_sessions_per_tier_and_host_or_replicas() -> None:
    tiers = kv_tiers.tier_capacity(131_072, 50 * 2**30, host_gib=100)
    assert tiers.sessions(16_384) == {"GPU": 25, "CPU": 50, "STORAGE": 0}
    # a working set of 3 pools on 4 replicas: 8 more replicas, or 2 pools' worth of host
    pool = tiers.gpu_tokens
    verdict = kv_tiers.host_or_replicas(
        12 * pool, 131_072, pool, 4, replica_hour_price=3.0, host_gib_hour_price=0.005,
        max_host_gib=200,
    )  # fmt: skip
    assert verdict.extra_replicas == 8
    assert verdict.host_gib_per_replica == pytest.approx(100)
    assert verdict.host_is_cheaper
    tight = kv_tiers.host_or_replicas(
        12 * pool, 131_072, pool, 4, replica_hour_price=3.0, host_gib_hour_price=0.005,
        max_host_gib=64,
    )  # fmt: skip
    assert not tight.host_is_cheaper  # the node cannot give that much memory
    fits = kv_tiers.host_or_replicas(
        pool, 131_072, pool, 4, replica_hour_price=3.0, host_gib_hour_price=0.005,
        max_host_gib=64,
    )  # fmt: skip
    assert (fits.extra_replicas, fits.host_gib_per_replica, fits.host_is_cheaper) == (0, 0, False)


@pytest.mark.parametrize(
    ("working_set", "price", "answer"),
    [
        ("4000000", "3", "host tier per replica ($1.30/h for the fleet), not 5 more replicas"),
        ("4000000", "0.01", "5 more replicas ($0.05/h), not 65.0 GiB host tier"),
        ("20000000", "3", "is over --max-host-gib 200"),
        ("1000000", "3", "the GPU pools hold it"),
    ],
)
def test_plan_gives_tiers_in_tokens_and_sessions_and_prices_host_against_replicas(
    capsys: pytest.CaptureFixture[str], working_set: str, price: str, answer: str
) -> None:
    from kubellm import cli

    code = cli.main([
        "plan", "--model", "llama-3.1-8b", "--context-tokens", "16384", "--gpu-hour-price",
        price, "--host-tier-gib", "100", "--working-set-tokens", working_set, "--replicas", "4",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "KV tokens per replica: CPU  " in out and "819,200 (50 sessions of 16,384" in out
    assert answer in out
