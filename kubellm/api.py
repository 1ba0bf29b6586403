"""The `LLMDeployment` API (group `kubellm.io`, version `v1alpha1`).

These pydantic models are the single source of truth for the resource: the
CRD in `crds/` is generated from them (`kubellm crds`), and every component
parses a manifest through them exactly once.

Cross-field rules are written once, as CEL expressions attached to the model
that owns them (`Rule`). The generated CRD carries them as
`x-kubernetes-validations`, so the Kubernetes API server enforces them; the
same expressions are evaluated here with `cel-python` when a model is built
outside a cluster (`kubellm up`, `kubellm render`, tests). One rule, one
message, whichever side rejects the manifest.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kubellm import cel

GROUP = "kubellm.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SINGULAR = "llmdeployment"
SHORT_NAMES = ("llmd",)

DEFAULT_ENGINE_IMAGE = "ghcr.io/kubellm/engine:0.1.0"
MODEL_SOURCE_SCHEMES = ("hf", "pvc", "file", "s3")

# The API server's resource.Quantity grammar (k8s.io/apimachinery/pkg/api/resource), without
# the sign: a resource request is never negative. The CRD carries it as the string's
# `pattern`, so `kubectl apply` refuses what `kubellm validate` refuses.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY = re.compile(QUANTITY_PATTERN)
# Integers in a manifest are int64 on the API server (int32 for replica counts).
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1

# Bounds on strings, lists and maps, far above real use. A real API server estimates the
# cost of a CEL rule from them (an unbounded string or list counts as the whole request,
# 3 MiB) and refuses a CRD whose rules' estimated cost is over its budget; bounds also keep
# what one manifest may make the operator hold (tests/kubellm/test_crd.py walks the schema).
MAX_URL = 2048  # a model or adapter source, the fallback URL
MAX_NAME = 253  # a Kubernetes object name (DNS subdomain), a model name
MAX_VALUE = 4096  # a free string: an image reference, one engine argument
MAX_ARGS = 256  # spec.engine.extraArgs
MAX_ENTRIES = 64  # tolerations, nodeSelector entries
MAX_STATUS_SAMPLES = 4096  # the autoscaler's windows: <= 3600 s at one sample per period


class Rule:
    """A CEL validation rule: `expression` must hold for `self` (the model's JSON)."""

    def __init__(self, expression: str, message: str, field_path: str | None = None) -> None:
        self.expression = expression
        self.message = message
        self.field_path = field_path

    def to_k8s(self) -> dict[str, str]:
        out = {"rule": self.expression, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


class _Model(BaseModel):
    """Base: camelCase on the wire, unknown fields rejected, CEL rules enforced."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,  # JSON has no infinity: the API server could not store it
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @field_validator("*", mode="after")
    @classmethod
    def _int64(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
            raise ValueError(f"{value} does not fit in a 64-bit integer (at most {INT64_MAX})")
        return value

    @model_validator(mode="after")
    def _check_rules(self) -> _Model:
        if self.rules:
            data = self.model_dump(by_alias=True, exclude_none=True, mode="json")
            for rule in self.rules:
                if not cel.holds(rule.expression, data):
                    raise ValueError(rule.message)
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        schema = handler(core_schema)
        if cls.rules:
            target = handler.resolve_ref_schema(schema)
            target["x-kubernetes-validations"] = [r.to_k8s() for r in cls.rules]
        return schema


def _nested(factory: type[_Model], description: str) -> Any:
    """A sub-object that is always present, defaulted to `{}` (so the API server defaults it)."""
    return Field(
        default_factory=factory, description=description, json_schema_extra={"default": {}}
    )


# --------------------------------------------------------------------------- model


class ModelArchitecture(_Model):
    """The model's shape, for capacity arithmetic (status.capacity and `kubellm plan`)."""

    num_layers: int = Field(ge=1, description="Transformer layers (num_hidden_layers).")
    num_kv_heads: int = Field(
        ge=1, alias="numKVHeads", description="KV heads (num_key_value_heads)."
    )
    head_dim: int = Field(ge=1, description="Dimension of one attention head.")
    params_billions: float = Field(gt=0, description="Parameter count, in billions.")


# A served model name: printable ASCII, no space at either end (an HTTP header value cannot
# hold a line break or a control character, and the HTTPRoute matches it in a header).
SERVED_NAME_PATTERN = r"^[!-~]([ -~]*[!-~])?$"


class ModelSpec(_Model):
    rules = (
        Rule(
            "self.source.matches('^(hf|pvc|file|s3)://.+$')",
            "spec.model.source must start with hf://, pvc://, file:// or s3:// "
            "followed by a location",
            ".source",
        ),
    )

    source: str = Field(
        max_length=MAX_URL,
        description="Where the weights come from: hf://org/name[@revision], "
        "pvc://claim/path, file:///path or s3://bucket/path.",
    )
    served_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        # It reaches HTTP headers (the HTTPRoute's model-name match, x-gateway-model-name):
        # printable ASCII only, no line break or control character, no edge space.
        pattern=SERVED_NAME_PATTERN,
        description="The model name clients send. Defaults to the LLMDeployment's name. "
        "Printable ASCII (it is matched in an HTTP header): no spaces at either end.",
    )
    architecture: ModelArchitecture | None = Field(
        default=None, description="Optional model shape used to report capacity in status."
    )


# --------------------------------------------------------------------------- engine


class ChunkedPrefill(_Model):
    enabled: bool = Field(default=True, description="Split long prompts across engine steps.")
    max_num_batched_tokens: int = Field(
        default=2048,
        ge=16,
        description="Token budget of one engine step (vLLM --max-num-batched-tokens).",
    )


class SpeculativeDecoding(_Model):
    rules = (
        Rule(
            "self.method == 'ngram' || has(self.model)",
            "spec.engine.speculative.model is required unless method is ngram",
            ".model",
        ),
    )

    method: Literal["ngram", "draft_model", "eagle", "eagle3", "mtp", "medusa"] = Field(
        description="Speculation method (vLLM speculative_config.method)."
    )
    model: str | None = Field(
        default=None, max_length=MAX_URL, description="Draft or head model, when one is needed."
    )
    num_speculative_tokens: int = Field(default=3, ge=1, le=16)
    prompt_lookup_max: int | None = Field(default=None, ge=1, description="ngram only.")


MAX_OFFLOAD_GIB = 65536  # 64 TiB: above any node's memory or local disk


class DiskTier(_Model):
    """The file-system tier below host memory: vLLM's TieringOffloadingSpec `fs` tier."""

    size_gib: float = Field(
        gt=0,
        le=MAX_OFFLOAD_GIB,
        alias="sizeGiB",
        description="Disk space for offloaded KV blocks, GiB: the emptyDir's sizeLimit, or "
        "what the claim must hold (vLLM's fs tier does not evict; the volume bounds it).",
    )
    claim_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME,
        description="A PersistentVolumeClaim for the tier (e.g. on local NVMe); unset: an "
        "emptyDir on the node's disk, lost with the pod.",
    )


class KVOffload(_Model):
    """KV blocks evicted from GPU memory kept in host memory (and on disk) and reloaded
    instead of recomputed (vLLM --kv-offloading-backend native --kv-offloading-size)."""

    host_gib: float = Field(
        gt=0,
        le=MAX_OFFLOAD_GIB,
        alias="hostGiB",
        description="Host-memory tier of one replica, GiB (summed over its GPUs, as vLLM's "
        "--kv-offloading-size); the pod's memory request grows by it.",
    )
    disk: DiskTier | None = Field(default=None, description="A file-system tier below it.")


# The vLLM arguments the launcher derives from the spec: extraArgs may not set them again.
OWNED_ENGINE_ARGS = (
    "--model", "--port", "--host", "--served-model-name", "--tensor-parallel-size",
    # the replica's shape and, across pods, its launch (launcher.parallel_args)
    "--pipeline-parallel-size", "--data-parallel-size", "--enable-expert-parallel",
    "--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless",
    "--distributed-executor-backend",
)  # fmt: skip
OWNED_SHORT_ARGS = {
    "-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size", "-n": "--nnodes", "-r": "--node-rank",
}  # fmt: skip


def owned_engine_arg(arg: str) -> str | None:
    """The owned argument `arg` sets as vLLM reads it, or None. vLLM's parser turns `_` into
    `-` in a long option's name and accepts any unambiguous prefix (`--hos` is `--host`),
    so every spelling that can reach an owned option is refused (tests/kubellm check it with
    vLLM's own parser)."""
    if not arg.startswith("-"):
        return None
    flag = arg.split("=", 1)[0]
    if not flag.startswith("--"):
        return OWNED_SHORT_ARGS.get(flag)
    flag = flag.replace("_", "-")
    if len(flag) <= 2:
        return None
    return next((o for o in OWNED_ENGINE_ARGS if o.startswith(flag)), None)


def extra_args_problem(args: list[str]) -> str | None:
    """Why `spec.engine.extraArgs` cannot be realised (an owned argument), or None: the
    operator refuses such a spec (InvalidEngineArguments) and `kubellm validate` too. Not a
    CRD rule: a spec the API server took stays readable, and its status says why."""
    for arg in args:
        owned = owned_engine_arg(arg)
        if owned is not None:
            return (
                f"spec.engine.extraArgs: {arg.split('=', 1)[0]} is vLLM's {owned}, which is set "
                "by the operator from the spec; remove it from extraArgs"
            )
    return None


class EngineSpec(_Model):
    rules = (
        Rule(
            "self.chunkedPrefill.enabled || !has(self.maxModelLen) "
            "|| self.chunkedPrefill.maxNumBatchedTokens >= self.maxModelLen",
            "spec.engine.chunkedPrefill.maxNumBatchedTokens must be >= spec.engine.maxModelLen "
            "when chunked prefill is disabled",
            ".chunkedPrefill.maxNumBatchedTokens",
        ),
        Rule(
            "!has(self.kvOffload) || self.prefixCaching",
            "spec.engine.kvOffload needs spec.engine.prefixCaching: offloaded blocks are found "
            "by their prefix hashes",
            ".kvOffload",
        ),
    )

    image: str = Field(
        default=DEFAULT_ENGINE_IMAGE,
        min_length=1,
        max_length=MAX_VALUE,
        description="Engine image.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="Weight and activation dtype."
    )
    quantization: (
        Literal["awq", "gptq", "fp8", "bitsandbytes", "compressed-tensors", "gguf"] | None
    ) = Field(default=None, description="Quantization method of the checkpoint.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto", description="KV-cache storage dtype; fp8 halves KV bytes per token."
    )
    max_model_len: int | None = Field(default=None, ge=1, description="Context length cap.")
    max_num_seqs: int | None = Field(default=None, ge=1, description="Concurrent sequences cap.")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Share of GPU memory vLLM may use."
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs one tensor-parallel group spans (vLLM --tensor-parallel-size): every "
        "layer split across them, an all-reduce per layer, so they stay inside one pod "
        "(fast links).",
    )
    pipeline_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Pipeline stages (vLLM --pipeline-parallel-size): the layers split into "
        "this many consecutive groups of tensorParallelSize GPUs; stages may sit on different "
        "pods (nodes), passing activations once per step.",
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Data-parallel ranks in one replica (vLLM --data-parallel-size): each a "
        "full copy of the attention with its own KV cache and batch; with expertParallel, "
        "the experts of a mixture-of-experts model spread over every rank (wide EP).",
    )
    expert_parallel: bool = Field(
        default=False,
        description="Split a mixture-of-experts model's experts across the replica's GPUs "
        "instead of tensor-splitting each expert (vLLM --enable-expert-parallel).",
    )
    prefix_caching: bool = Field(default=True, description="Reuse KV blocks of shared prefixes.")
    chunked_prefill: ChunkedPrefill = _nested(ChunkedPrefill, "Chunked prefill settings.")
    kv_offload: KVOffload | None = Field(
        default=None,
        description="KV-cache offload tiers below GPU memory (host memory, then disk); needs "
        "prefixCaching. Unset: no offload (docs/operations.md, 'When a host-memory tier pays').",
    )
    speculative: SpeculativeDecoding | None = Field(
        default=None, description="Speculative decoding (vLLM --speculative-config)."
    )
    block_size: int | None = Field(default=None, ge=1, description="KV block size in tokens.")
    max_loras: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="LoRA adapters one engine step can serve at once (vLLM --max-loras; "
        "unset: 4 when spec.adapters lists any). Setting it enables LoRA even without "
        "adapters, so adapters added later load without a restart.",
    )
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] | None = Field(
        default=None,
        description="Largest adapter rank the engine accepts (vLLM --max-lora-rank, default 16).",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Engine HTTP port.")
    extra_args: list[Annotated[str, Field(max_length=MAX_VALUE)]] = Field(
        default_factory=list,
        max_length=MAX_ARGS,
        json_schema_extra={"default": []},
        description="Extra vLLM arguments, passed last, unchanged. The arguments the "
        "launcher derives from the spec (--model, --port, --host, --served-model-name, the "
        "parallel sizes -tp/-pp/-dp, --enable-expert-parallel, and the multi-node launch: "
        "--nnodes, --node-rank, --master-addr, --master-port, --headless, "
        "--distributed-executor-backend) are refused in any spelling vLLM accepts.",
    )


# --------------------------------------------------------------------------- resources


class GPUResources(_Model):
    count: int = Field(
        default=1,
        ge=0,
        le=64,
        description="GPUs of one pod (0: CPU engine); a replica has count x spec.resources.nodes.",
    )
    resource_name: str = Field(default="nvidia.com/gpu", min_length=1, max_length=MAX_NAME)
    memory_gib: float | None = Field(
        default=None, gt=0, alias="memoryGiB", description="Memory of one GPU, for capacity."
    )
    bandwidth_gbps: float | None = Field(
        default=None, gt=0, alias="bandwidthGBps", description="Memory bandwidth, GB/s."
    )


class Resources(_Model):
    gpu: GPUResources = _nested(GPUResources, "GPUs of one pod.")
    nodes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Pods (one per node) one replica spans. Over 1, each replica is a "
        "LeaderWorkerSet group: the leader serves the API, the others join it headless "
        "(the LeaderWorkerSet controller must be installed; docs/operations.md).",
    )
    cpu: str | None = Field(
        default=None,
        description="CPU request, a Kubernetes quantity: '8', '500m'.",
        max_length=64,
        json_schema_extra={"pattern": QUANTITY_PATTERN},
    )
    memory: str | None = Field(
        default=None,
        description="Memory request, a Kubernetes quantity: '64Gi', '512Mi', '4G'.",
        max_length=64,
        json_schema_extra={"pattern": QUANTITY_PATTERN},
    )

    @field_validator("cpu", "memory")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and not _QUANTITY.match(value):
            raise ValueError(
                f"{value!r} is not a Kubernetes quantity: a number with an optional suffix "
                "(m, k, M, G, T, Ki, Mi, Gi, Ti), e.g. '500m', '2', '4Gi'"
            )
        return value


# --------------------------------------------------------------------------- autoscaling


class Autoscaling(_Model):
    rules = (
        Rule(
            "self.minReplicas <= self.maxReplicas",
            "spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas",
            ".minReplicas",
        ),
    )

    enabled: bool = Field(default=True, description="The kubellm autoscaler drives /scale.")
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    target_kv_cache_usage: float = Field(
        default=0.8,
        gt=0,
        le=1,
        alias="targetKVCacheUsage",
        description="Mean KV-cache pool occupancy per replica to aim for.",
    )
    target_queue_depth: float = Field(
        default=4, gt=0, description="Waiting requests per replica to aim for."
    )
    scale_up_stabilization_seconds: int = Field(default=0, ge=0, le=3600)
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="How long a lower recommendation must hold before replicas are removed "
        "(at most an hour, as the HorizontalPodAutoscaler's window).",
    )
    scale_to_zero: bool = Field(default=False, description="Allow zero replicas when idle.")
    idle_seconds_before_zero: int = Field(default=600, ge=0)
    target_requests_per_replica: float | None = Field(
        default=None,
        gt=0,
        description="Requests per second one replica serves within the SLO. When set, the "
        "request rate the gateway sees (kubellm_gateway_requests_total) divided by it is a "
        "floor on the replica count; unset, the autoscaler derives it from what the "
        "replicas answer while saturated.",
    )
    max_fallback_share: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="With spec.fallback set: the share of requests the fallback may take over "
        "the scale-down window before load adds a replica; spikes under it go to the "
        "fallback. 0: any overflow is a reason to scale up.",
    )
    fallback_cost_ratio: float | None = Field(
        default=None,
        gt=0,
        description="With spec.fallback set: what the fallback API charges per second for the "
        "load of one replica (targetRequestsPerReplica requests/s of your request mix) over "
        "what one replica costs per second (its GPUs' hourly price / 3600); `kubellm plan "
        "--trace` prints it for your prices and traffic. Set, an overflow goes to the "
        "fallback until it has lasted long enough that replicas cost less, and a scale-down "
        "waits as long as a re-spike at the API would cost (at most "
        "scaleDownStabilizationSeconds). Unset: maxFallbackShare and the fixed window.",
    )
    model_load_seconds: int = Field(
        default=60,
        ge=0,
        description="Seconds from a new replica's creation to ready (image pull and weight "
        "load): the cost rule's estimate of how long the fallback takes an overflow before "
        "a replica added for it serves.",
    )
    predictive: bool = Field(
        default=False,
        description="Also ask for the load one modelLoadSeconds ahead where the arrival rate "
        "has grown steadily over the last two model loads (beyond Poisson noise in each of "
        "three blocks), so replicas are ready when the load arrives; never lowers an ask. A "
        "step or a burst is not a trend and is left to the reactive signals.",
    )


# --------------------------------------------------------------------------- routing, fallback, SLO


class Timeouts(_Model):
    """How long the gateway waits on a replica at each stage (unset: the gateway's defaults,
    `kubellm gateway --help`; docs/operations.md, "Timeouts and limits")."""

    connect_seconds: float | None = Field(
        default=None, gt=0, le=300, description="Opening a connection to a replica."
    )
    first_byte_seconds: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description="From sending a request to its first body byte (non-streamed requests "
        "go to replicas as streams too); past it the request is retried on another "
        "replica and this one ejected. Default: 5 x slo.ttftSeconds, at least 10 s.",
    )
    idle_seconds: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description="The longest silence between two chunks of a stream.",
    )
    total_seconds: float | None = Field(
        default=None,
        gt=0,
        le=86400,
        description="The whole request, retries included (and the only bound of the "
        "non-streamed requests that cannot go to a replica as a stream). Also the "
        "`timeouts.request` of the HTTPRoute the operator creates for "
        "spec.routing.inferencePool (unset there: 600 s, the gateway's default).",
    )


_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class TenantsSecretRef(_Model):
    name: str = Field(
        min_length=1, max_length=253, description="The Secret, in the LLMDeployment's namespace."
    )
    key: str = Field(
        default="tenants.yaml", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
        description="The Secret's key holding the tenants file.",
    )  # fmt: skip


class EndpointPicker(_Model):
    """The endpoint picker (EPP) a Gateway calls for the pool's requests. By default the
    operator runs one for this pool alone (`kubellm epp --pool-name <name>-engine`: a
    Deployment and Service `<name>-epp` in the LLMDeployment's namespace, with a Role that
    reads only that namespace), as the Inference Extension's picker serves one pool; `name`
    points the pool at an existing picker Service of the pool's namespace instead (the
    Inference Extension's `endpointPickerRef` names a Service of the pool's own namespace)."""

    rules = (
        Rule(
            "!has(self.name) || !has(self.tenantsSecretRef)",
            "spec.routing.inferencePool.endpointPicker.tenantsSecretRef is for the operator's "
            "own picker: a picker named by `name` reads its own tenants file",
            ".tenantsSecretRef",
        ),
    )

    name: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=_DNS_LABEL,
        description="An existing EPP Service to use (e.g. the chart's shared `kubellm-epp`, "
        "or one started with --pool-name); the operator then runs no picker for this pool. "
        "Unset: the operator's own picker for this pool, `<name>-epp` (or the shared picker "
        "the operator is configured with: the chart's operator.endpointPicker.mode shared).",
    )  # fmt: skip
    port: int = Field(default=9002, ge=1, le=65535, description="The EPP Service's gRPC port.")
    replicas: int = Field(
        default=1,
        ge=1,
        le=16,
        description="Replicas of the operator's own picker (name unset); each keeps its own "
        "load view, as gateway replicas do.",
    )
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description="What the Gateway does when the EPP does not answer: FailClose refuses "
        "the request, FailOpen sends it to a pool endpoint of the Gateway's own choosing.",
    )
    tenants_secret_ref: TenantsSecretRef | None = Field(
        default=None,
        description="A Secret of this namespace holding the tenants file (docs/operations.md, "
        "'Tenants'), mounted into the operator's own picker (name unset) as `kubellm epp "
        "--tenants`; its pods roll when the file changes. Unset: no tenants (every request "
        "alike).",
    )


class GatewayParentRef(_Model):
    """A Gateway (Gateway API) whose listeners take the HTTPRoute the operator creates."""

    name: str = Field(min_length=1, max_length=253)
    namespace: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=_DNS_LABEL,
        description="Default: the LLMDeployment's namespace.",
    )  # fmt: skip
    section_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN,
        description="One listener of the Gateway (default: all that allow the route).",
    )  # fmt: skip


class InferencePoolRouting(_Model):
    """Serve this deployment through a Gateway API implementation (Istio, kgateway, Envoy
    Gateway, GKE, ...) with the Gateway API Inference Extension: the operator creates an
    `InferencePool` (inference.networking.k8s.io/v1) selecting the engine pods, whose
    endpoint picker is kubellm's (`kubellm epp`, by default one the operator runs for this
    pool alone), and, with `parentRefs`, an `HTTPRoute` from those Gateways to the pool
    whose request timeout is spec.routing.timeouts.totalSeconds (default 600 s). Without
    the Inference Extension's CRDs nothing is created and the `InferencePool` condition
    says why."""

    endpoint_picker: EndpointPicker = Field(default_factory=EndpointPicker)
    parent_refs: list[GatewayParentRef] = Field(
        default_factory=list,
        max_length=32,
        description="Gateways to attach an HTTPRoute to; empty: no HTTPRoute (bring your own "
        "route with the InferencePool as its backendRef).",
    )
    match_model_header: bool = Field(
        default=False,
        description="Match only requests whose X-Gateway-Model-Name header is the served "
        "model name, so several models can share one Gateway (the Inference Extension's "
        "body-based router sets the header from the body's `model`).",
    )


class Routing(_Model):
    policy: Literal["prefix-aware", "least-load", "round-robin", "slo-aware"] = Field(
        default="prefix-aware",
        description="How a replica is chosen: prefix-aware (the replica holding the prompt's "
        "prefix, bounded by load), least-load, round-robin, or slo-aware (the replica whose "
        "learnt TTFT and ITL predictions best keep the request within spec.slo; admission "
        "sends it to the fallback when no replica's predicted TTFT fits).",
    )
    load_bound: float = Field(
        default=1.25,
        ge=1,
        description="A replica may take a prefix-aware request while its load is at most "
        "loadBound x the mean load; one that holds at least half of the request's prompt "
        "prefix, while at most 2 x loadBound x the mean.",
    )
    prefix_index: Literal["approximate", "precise"] = Field(
        default="approximate",
        description="How prefix-aware routing knows what each replica caches: approximate "
        "(from what the gateway sent it) or precise (from the engines' own KV-cache events, "
        "published on kvEventsPort; a replica whose events are missing or stale falls back "
        "to approximate).",
    )
    kv_events_port: int = Field(
        default=5557,
        ge=1,
        le=65534,
        description="With prefixIndex precise: the engine publishes its KV-cache events "
        "here and answers replay requests on the next port.",
    )
    timeouts: Timeouts = _nested(Timeouts, "How long the gateway waits on a replica at each stage.")
    inference_pool: InferencePoolRouting | None = Field(
        default=None,
        description="Also serve through a Gateway API Inference Extension InferencePool, with "
        "kubellm's endpoint picker.",
    )


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, max_length=MAX_NAME)
    key: str = Field(default="api-key", min_length=1, max_length=MAX_NAME)


class Fallback(_Model):
    rules = (
        Rule("has(self.url)", "spec.fallback.url is required when fallback is set", ".url"),
        Rule(
            "has(self.apiKeySecretRef)",
            "spec.fallback.apiKeySecretRef is required when fallback is set",
            ".apiKeySecretRef",
        ),
        Rule(
            "!has(self.url) || self.url.startsWith('http://') || self.url.startsWith('https://')",
            "spec.fallback.url must be an http:// or https:// URL",
            ".url",
        ),
        Rule(
            "!has(self.url) || !self.url.matches('^[a-zA-Z]+://[^/?#]*@')",
            "spec.fallback.url must not carry credentials (user:password@): the API key "
            "goes in spec.fallback.apiKeySecretRef",
            ".url",
        ),
    )

    url: str | None = Field(
        default=None, max_length=MAX_URL, description="Base URL of an OpenAI-compatible API."
    )
    model: str | None = Field(
        default=None, max_length=MAX_NAME, description="Model name at the fallback API."
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding the fallback API key."
    )
    max_concurrency: int = Field(default=64, ge=1)
    triggers: list[Literal["saturated", "no-ready-replicas"]] = Field(
        default_factory=lambda: ["saturated", "no-ready-replicas"],
        max_length=8,
        json_schema_extra={"default": ["saturated", "no-ready-replicas"]},
        description="When to send a request to the fallback.",
    )


class SLO(_Model):
    ttft_seconds: float = Field(default=2.0, gt=0, description="Time-to-first-token target.")
    itl_seconds: float = Field(default=0.1, gt=0, description="Inter-token latency target.")
    objective: float = Field(
        default=0.99, gt=0, lt=1, description="Share of requests that must meet both targets."
    )


class Scheduling(_Model):
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_ENTRIES, json_schema_extra={"default": {}}
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=MAX_ENTRIES,
        json_schema_extra={"default": [], "items": {"type": "object"}},
    )
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = Field(default=None, max_length=MAX_NAME)


# The most canary steps a rollout lists: bounds the CEL rules' cost (the ordering rule is
# unrolled over consecutive pairs).
MAX_CANARY_STEPS = 10


class CanaryStep(_Model):
    """One step of a canary rollout: the share of traffic (and of capacity) the new revision
    takes, and how long it must hold the analysis before the next step."""

    weight: int = Field(
        ge=0,
        le=99,
        description="Percent of requests (and of replicas) the canary takes. 0: a shadow "
        "step, first only: one canary replica answers only mirrored requests "
        "(spec.rollout.shadow), judged by analysis.quality alone, before any client's.",
    )
    pause_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="The step's analysis window: the canary must pass the analysis over it "
        "(with at least analysis.minRequests requests) before the next step.",
    )


class RolloutQuality(_Model):
    """Thresholds on the canary's answers to mirrored requests, compared with the stable
    revision's answers to the same requests (greedy or seeded decoding)."""

    min_agreement: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="The share of mirrored requests whose first k tokens agree must be at "
        "least this: the gate fails when even the share's upper confidence bound (at "
        "analysis.significance) is below it.",
    )
    min_token_agreement: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="The share of compared token positions that agree must be at least this.",
    )
    max_divergence: float = Field(
        default=0.1,
        ge=0,
        le=100,
        description="With logprobs: the mean divergence (nats per token) of the canary's "
        "token distributions from the stable one's on the stable answer's tokens may be at "
        "most this.",
    )
    min_mirrored_requests: int = Field(
        default=50,
        ge=1,
        le=1_000_000,
        description="Mirrored requests compared in the window before a quality verdict.",
    )


class RolloutAnalysis(_Model):
    """What a canary step must hold over its window, against the stable revision (from the
    gateway's per-revision figures). A failed check rolls the canary back at once; too few
    requests keep the step waiting."""

    min_requests: int = Field(
        default=50,
        ge=1,
        description="Requests the canary must answer in a step's window before a verdict "
        "(pass or fail) is drawn.",
    )
    max_error_rate: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description="The canary's error rate may exceed the stable revision's by at most this "
        "much (0.02: two points).",
    )
    max_ttft_ratio: float = Field(
        default=1.5,
        ge=1,
        alias="maxTTFTRatio",
        description="The canary's mean time to first token may be at most this many times "
        "the stable revision's.",
    )
    max_itl_ratio: float = Field(
        default=1.5,
        ge=1,
        alias="maxITLRatio",
        description="The canary's mean inter-token latency may be at most this many times "
        "the stable revision's.",
    )
    max_burn_rate: float = Field(
        default=2.0,
        gt=0,
        description="The canary's SLO error-budget burn rate ((1 - share of requests meeting "
        "slo.ttftSeconds and slo.itlSeconds) / (1 - slo.objective)) may exceed the stable "
        "revision's by at most this much.",
    )
    min_clients: int = Field(
        default=5,
        ge=1,
        le=1_000_000,
        description="Distinct clients (tenants where tenants are declared, else sessions or "
        "prompts) the canary must have answered in the window before a verdict: one client "
        "never decides a rollout.",
    )
    min_class_requests: int = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description="Answers the canary needs in each prompt-size class the model serves "
        "(see minClassShare) before a verdict; also the streamed answers each side needs in "
        "a class before its latencies are compared.",
    )
    min_class_share: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="A prompt-size class carrying at least this share of the stable "
        "revision's answers must be seen by the canary (minClassRequests) before a verdict.",
    )
    significance: float = Field(
        default=0.01,
        gt=0,
        lt=0.5,
        description="The false-alarm rate of the latency test (one-sided Mann-Whitney per "
        "class and figure, Bonferroni-corrected): a slower canary fails only when its "
        "slowdown is this unlikely under no difference.",
    )
    min_ttft_difference_seconds: float = Field(
        default=0.05,
        ge=0,
        le=3600,
        alias="minTTFTDifferenceSeconds",
        description="A TTFT ratio over maxTTFTRatio counts only when the medians also differ "
        "by more than this (a few ms of noise are no regression).",
    )
    min_itl_difference_seconds: float = Field(
        default=0.005,
        ge=0,
        le=60,
        alias="minITLDifferenceSeconds",
        description="A time-per-token ratio over maxITLRatio counts only when the medians "
        "also differ by more than this.",
    )
    quality: RolloutQuality | None = Field(
        default=None,
        description="The answer-quality gate on mirrored requests (spec.rollout.shadow); "
        "unset: no quality gate.",
    )


class RolloutShadow(_Model):
    """The shadow step: a bounded sample of the stable revision's live requests is sent to
    the canary as well; the client gets the stable answer, the canary's is only compared."""

    share: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="The share of stable requests mirrored to the canary.",
    )
    max_concurrency: int = Field(
        default=4,
        ge=1,
        le=10_000,
        description="Mirrored requests in flight at once per gateway; past it (or while the "
        "canary queues) a mirror is shed, never the stable answer.",
    )
    first_tokens: int = Field(
        default=16,
        ge=1,
        le=256,
        description="k: a mirrored request agrees when both revisions' greedy answers agree "
        "on their first k tokens. Both are asked for at most 2k tokens.",
    )


def _default_steps() -> list[CanaryStep]:
    return [CanaryStep(weight=10), CanaryStep(weight=50)]


DEFAULT_CANARY_STEPS = [{"weight": 10, "pauseSeconds": 300}, {"weight": 50, "pauseSeconds": 300}]


class Rollout(_Model):
    """How a new revision (a change to the engine identity: spec.model, spec.engine,
    spec.resources, spec.routing.prefixIndex precise) replaces the running one. Scaling,
    routing, fallback, SLO and adapter edits never start a revision.

    Rolling: the engine Deployment's rolling update (maxSurge, maxUnavailable).
    Canary: a second Deployment runs the new revision and takes each step's weight of the
    traffic and capacity while the analysis holds; it is promoted after the last step and
    rolled back (scaled to zero, 100% to stable) when a check fails."""

    rules = (
        Rule(
            "self.strategy != 'Canary' || size(self.steps) > 0",
            "spec.rollout.steps must list at least one step when strategy is Canary",
            ".steps",
        ),
        Rule(
            " && ".join(
                f"(size(self.steps) <= {i + 1} || self.steps[{i}].weight < "
                f"self.steps[{i + 1}].weight)"
                for i in range(MAX_CANARY_STEPS - 1)
            ),
            "spec.rollout.steps weights must increase from one step to the next",
            ".steps",
        ),
        Rule(
            "self.steps.all(s, s.weight > 0) || (has(self.shadow) && has(self.analysis) "
            "&& has(self.analysis.quality))",
            "spec.rollout.steps: a step of weight 0 (the shadow step) needs spec.rollout.shadow "
            "and spec.rollout.analysis.quality (it is judged on mirrored requests alone)",
            ".steps",
        ),
    )

    strategy: Literal["Rolling", "Canary"] = Field(
        default="Rolling",
        description="Rolling: replace pods one by one. Canary: run the new revision beside "
        "the stable one, shift traffic by steps, promote or roll back by the analysis.",
    )
    max_surge: int | str = Field(
        default=1,
        description="Extra pods during a rollout (a count or a percentage such as '25%').",
    )
    max_unavailable: int | str = Field(
        default=0,
        description="Pods that may be unready during a rollout; 0 keeps serving capacity.",
    )
    steps: list[CanaryStep] = Field(
        default_factory=_default_steps,
        max_length=MAX_CANARY_STEPS,
        json_schema_extra={"default": DEFAULT_CANARY_STEPS},
        description="Canary only: the weights the new revision takes, in increasing order; "
        "after the last step passes it is promoted to 100%.",
    )
    analysis: RolloutAnalysis = _nested(
        RolloutAnalysis, "Canary only: what each step must hold against the stable revision."
    )
    shadow: RolloutShadow | None = Field(
        default=None,
        description="Canary only: mirror a sample of the stable revision's traffic to the "
        "canary (its answers are compared, never returned); unset: no mirror.",
    )


# --------------------------------------------------------------------------- adapters

# The most adapters one LLMDeployment lists: bounds the CEL rules' cost on the API server.
MAX_ADAPTERS = 64
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$"


class Adapter(_Model):
    """A LoRA adapter of the base model, served under its own model name."""

    rules = (
        Rule(
            "self.source.matches('^(hf|pvc|file|s3)://.+$')",
            "spec.adapters[].source must start with hf://, pvc://, file:// or s3:// "
            "followed by a location",
            ".source",
        ),
    )

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=ADAPTER_NAME_PATTERN,
        description="The model name clients send to use this adapter.",
    )
    source: str = Field(
        max_length=2048,
        description="Where the adapter's weights come from: hf://org/name[@revision], "
        "pvc://claim/path or file:///path.",
    )


# --------------------------------------------------------------------------- prefill/decode


class KVConnector(_Model):
    """How a prefill replica's KV cache reaches a decode replica: vLLM's
    `--kv-transfer-config` on both roles (prefill `kv_producer`, decode `kv_consumer`)."""

    type: Literal["Nixl", "LMCache", "Mooncake", "P2pNccl", "Example"] = Field(
        default="Nixl",
        description="The vLLM KV connector: Nixl (NixlConnector, the default on GPUs), "
        "LMCache, Mooncake, P2pNccl, or Example (vLLM's storage-based debug connector).",
    )
    extra_config: dict[str, Annotated[str, Field(max_length=MAX_VALUE)]] = Field(
        default_factory=dict,
        max_length=MAX_ENTRIES,
        json_schema_extra={"default": {}},
        description="Entries of the connector's kv_connector_extra_config, passed through.",
    )
    link_bandwidth_gbps: float | None = Field(
        default=None,
        gt=0,
        alias="linkBandwidthGBps",
        description="The KV link's bandwidth between a prefill and a decode pod, GB/s "
        "(unset: the GPU profile's figure for the connector's transport).",
    )


class PrefillEngine(_Model):
    """Engine settings that differ on the prefill role; unset ones are spec.engine's."""

    tensor_parallel_size: int | None = Field(default=None, ge=1, le=64)
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="The prefill role's token budget per engine step."
    )
    max_num_seqs: int | None = Field(default=None, ge=1)


class PrefillAutoscaling(_Model):
    """The prefill role's autoscaling: replicas enough to clear the queued prefill work within
    a share of the TTFT budget (llm-d's token-aware recipe), never more prefill replicas
    than zero while the decode role has none."""

    rules = (
        Rule(
            "self.minReplicas <= self.maxReplicas",
            "spec.prefill.autoscaling.minReplicas must not exceed "
            "spec.prefill.autoscaling.maxReplicas",
            ".minReplicas",
        ),
    )

    enabled: bool = Field(
        default=True, description="The kubellm autoscaler writes spec.prefill.replicas."
    )
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    target_queue_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        alias="targetQueueShare",
        description="The share of slo.ttftSeconds the queued prefill work of a prefill "
        "replica may take (queued prompt tokens over its prefill throughput).",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="How long a lower recommendation must hold before prefill replicas go.",
    )


class Prefill(_Model):
    """A prefill role beside the decode role. With `spec.prefill` set, the replicas of
    the rest of the spec (`spec.replicas`, `engine`, `resources`, `autoscaling`) are the
    decode role; a request is split (prompt on a prefill replica, its KV moved to the
    decode replica) when the gateway predicts the split serves it and the requests
    already decoding better than local prefill (`Conditional`), or always (`Always`)."""

    split: Literal["Conditional", "Always"] = Field(
        default="Conditional",
        description="When a request's prefill runs on the prefill role: Conditional "
        "(when the prediction says it pays) or Always (for comparison).",
    )
    replicas: int = Field(default=1, ge=0, le=INT32_MAX, description="Desired prefill replicas.")
    engine: PrefillEngine = _nested(PrefillEngine, "Engine overrides for the prefill role.")
    resources: Resources | None = Field(
        default=None, description="Resources of one prefill replica (unset: spec.resources)."
    )
    autoscaling: PrefillAutoscaling | None = Field(
        default=None,
        description="Scale the prefill role on its queued prefill work; off when absent.",
    )
    kv_connector: KVConnector = Field(
        default_factory=KVConnector,
        alias="kvConnector",
        json_schema_extra={"default": {}},
        description="How the KV cache moves from prefill to decode.",
    )


class LLMDeploymentSpec(_Model):
    rules = (
        Rule(
            "self.engine.tensorParallelSize <= "
            "(self.resources.gpu.count == 0 ? 1 : self.resources.gpu.count)",
            "spec.engine.tensorParallelSize must not exceed spec.resources.gpu.count (a "
            "tensor-parallel group stays inside one pod)",
            ".engine.tensorParallelSize",
        ),
        Rule(
            "(self.resources.nodes == 1 && self.engine.pipelineParallelSize == 1 "
            "&& self.engine.dataParallelSize == 1) || self.engine.tensorParallelSize * "
            "self.engine.pipelineParallelSize * self.engine.dataParallelSize == "
            "(self.resources.gpu.count == 0 ? 1 : self.resources.gpu.count) * "
            "self.resources.nodes",
            "spec.engine.tensorParallelSize x spec.engine.pipelineParallelSize x "
            "spec.engine.dataParallelSize must equal spec.resources.gpu.count x "
            "spec.resources.nodes (one rank per GPU of the replica)",
            ".engine.pipelineParallelSize",
        ),
        Rule(
            "self.resources.nodes == 1 || self.resources.gpu.count == 0 || "
            "self.resources.gpu.count % self.engine.tensorParallelSize == 0",
            "spec.resources.gpu.count must be a multiple of spec.engine.tensorParallelSize "
            "when spec.resources.nodes is over 1 (no tensor-parallel group spans two pods)",
            ".resources.gpu.count",
        ),
        Rule(
            "!has(self.prefill) || self.resources.nodes == 1",
            "spec.prefill cannot be combined with spec.resources.nodes over 1 (a prefill/decode "
            "pair of multi-node replicas is not supported yet)",
            ".prefill",
        ),
        Rule(
            "!has(self.prefill) || !has(self.prefill.engine.tensorParallelSize) || "
            "self.prefill.engine.tensorParallelSize <= (has(self.prefill.resources) ? "
            "(self.prefill.resources.gpu.count == 0 ? 1 : self.prefill.resources.gpu.count) : "
            "(self.resources.gpu.count == 0 ? 1 : self.resources.gpu.count))",
            "spec.prefill.engine.tensorParallelSize must not exceed the prefill pod's GPUs "
            "(spec.prefill.resources.gpu.count, else spec.resources.gpu.count)",
            ".prefill.engine.tensorParallelSize",
        ),
        Rule(
            "!has(self.prefill) || !has(self.prefill.resources) || "
            "(self.prefill.resources.gpu.count == 0) == (self.resources.gpu.count == 0)",
            "spec.prefill.resources.gpu.count must be 0 exactly when spec.resources.gpu.count "
            "is 0 (both roles on GPUs or both on CPUs: the KV cache moves between like buffers)",
            ".prefill.resources.gpu.count",
        ),
        Rule(
            "!has(self.prefill) || !has(self.prefill.engine.maxNumBatchedTokens) || "
            "self.engine.chunkedPrefill.enabled || !has(self.engine.maxModelLen) || "
            "self.prefill.engine.maxNumBatchedTokens >= self.engine.maxModelLen",
            "spec.prefill.engine.maxNumBatchedTokens must be >= spec.engine.maxModelLen when "
            "chunked prefill is disabled",
            ".prefill.engine.maxNumBatchedTokens",
        ),
        Rule(
            "!has(self.prefill) || self.prefill.kvConnector.type != 'P2pNccl' || "
            "self.resources.gpu.count > 0",
            "spec.prefill.kvConnector.type P2pNccl needs GPUs (spec.resources.gpu.count over 0): "
            "NCCL moves GPU memory; use Nixl or Example on CPUs",
            ".prefill.kvConnector.type",
        ),
        Rule(
            "!has(self.adapters) || self.adapters.all(a, self.adapters.exists_one(b, "
            "b.name == a.name))",
            "spec.adapters names must be unique",
            ".adapters",
        ),
    )

    model: ModelSpec
    adapters: list[Adapter] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        json_schema_extra={"default": []},
        description="LoRA adapters of the model, each served under its own name; loaded on "
        "running replicas where requests use them, without a restart.",
    )
    engine: EngineSpec = _nested(EngineSpec, "How vLLM runs the model.")
    resources: Resources = _nested(Resources, "Resources of one replica.")
    replicas: int = Field(
        default=1, ge=0, le=INT32_MAX, description="Desired replicas (the scale subresource)."
    )
    autoscaling: Autoscaling | None = Field(
        default=None, description="Scale on KV-cache occupancy and queue depth; off when absent."
    )
    routing: Routing = _nested(Routing, "How the gateway picks a replica.")
    fallback: Fallback | None = Field(default=None, description="Overflow to an external API.")
    prefill: Prefill | None = Field(
        default=None,
        description="A prefill role (prefill/decode disaggregation); the rest of the spec is "
        "then the decode role. Absent: every replica serves both phases.",
    )
    slo: SLO = _nested(SLO, "Latency targets for goodput, metrics and alerts.")
    scheduling: Scheduling = _nested(Scheduling, "Where engine pods may run.")
    rollout: Rollout = _nested(
        Rollout, "How a new revision replaces the running one: Rolling or Canary."
    )
    termination_grace_period_seconds: int = Field(
        default=120, ge=0, description="Time a removed replica gets to finish in-flight requests."
    )


# --------------------------------------------------------------------------- status


class _Status(_Model):
    """Status is written by kubellm; tolerate fields from newer versions."""

    model_config = ConfigDict(extra="ignore")


class Condition(_Status):
    type: Literal["Ready", "Progressing", "Degraded", "RolledBack", "InferencePool"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1)
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class Capacity(_Status):
    kv_bytes_per_token: int | None = None
    kv_bytes_per_request: int | None = None
    weight_bytes: int | None = None
    kv_pool_bytes: int | None = None
    weight_bytes_per_gpu: int | None = Field(default=None, alias="weightBytesPerGPU")
    kv_pool_bytes_per_gpu: int | None = Field(default=None, alias="kvPoolBytesPerGPU")
    max_concurrent_sequences: int | None = None
    decode_tokens_per_second_bound: float | None = None
    kv_tokens_gpu: int | None = Field(default=None, alias="kvTokensGPU")
    kv_tokens_host: int | None = None
    kv_tokens_disk: int | None = None


class AutoscalerRecommendation(_Status):
    """One past recommendation, kept for the scale-down stabilisation window."""

    time: str = Field(description="RFC 3339 time, milliseconds.")
    replicas: int


class AutoscalerRequestSample(_Status):
    """The gateway's cumulative request count for the model at one time (for its rate)."""

    time: str = Field(description="RFC 3339 time, milliseconds.")
    count: float


class AutoscalerGatewaySample(_Status):
    """The gateway's cumulative counts for the model at one time (fallback share, answers)."""

    time: str = Field(description="RFC 3339 time, milliseconds.")
    admitted: float
    fallback: float
    replica: float


class PrefillRecommendation(_Status):
    """One past recommendation for the prefill role (time: seconds since the epoch)."""

    time: float
    replicas: int


class PrefillAutoscalerStatus(_Status):
    """The prefill role's autoscaling (spec.prefill.autoscaling): its decision, and what it
    learns (one replica's prompt tokens/s while saturated) and last sampled."""

    desired_replicas: int | None = None
    reason: str | None = None
    message: str | None = None
    tokens_per_second: float | None = Field(
        default=None, description="Prompt tokens/s one prefill replica computed while saturated."
    )
    queued_seconds: float | None = Field(
        default=None, description="Queued and running prefill work, seconds of one replica."
    )
    prompt_tokens: float | None = Field(
        default=None, description="The ready prefill replicas' prompt tokens at sampleTime."
    )
    sample_time: float | None = None
    ready: int | None = None
    saturated: bool | None = None
    recommendations: list[PrefillRecommendation] | None = Field(
        default=None, max_length=MAX_STATUS_SAMPLES
    )


class AutoscalerStatus(_Status):
    """Written by the autoscaler only; its state lives here so a restart loses nothing."""

    prefill: PrefillAutoscalerStatus | None = Field(
        default=None, description="The prefill role's (spec.prefill.autoscaling)."
    )

    desired_replicas: int | None = None
    reason: str | None = None
    message: str | None = None
    last_scale_time: str | None = None
    kv_cache_usage: float | None = Field(default=None, alias="kvCacheUsage")
    queue_depth: float | None = None
    recommendations: list[AutoscalerRecommendation] | None = Field(
        default=None,
        max_length=MAX_STATUS_SAMPLES,
        description="Recommendations inside the scale-down window.",
    )
    idle_since: str | None = Field(default=None, description="Start of the idle period.")
    request_rate: float | None = Field(
        default=None, description="Requests per second arriving at the gateway (last 30 s)."
    )
    request_samples: list[AutoscalerRequestSample] | None = Field(
        default=None,
        max_length=MAX_STATUS_SAMPLES,
        description="The gateway's request counts inside the rate window.",
    )
    gateway_samples: list[AutoscalerGatewaySample] | None = Field(
        default=None,
        max_length=MAX_STATUS_SAMPLES,
        description="The gateway's admitted, fallback and replica-answered counts inside the "
        "scale-down window.",
    )
    fallback_share: float | None = Field(
        default=None, description="Share of requests the fallback took over the window."
    )
    learned_requests_per_replica: float | None = Field(
        default=None,
        description="Requests/s one replica answered while every replica was saturated.",
    )
    saturated_since: str | None = Field(
        default=None, description="Since when every ready replica has been saturated."
    )
    overflow_since: str | None = Field(
        default=None,
        description="Since when the signals have asked for more replicas than there are.",
    )
    peak_requests_per_replica: float | None = Field(
        default=None,
        ge=0,
        description="The most requests/s one replica has answered over a control period "
        "(the derived rate until one is learned).",
    )


class AdapterStatus(_Status):
    """Where one adapter of spec.adapters is loaded: on `loadedReplicas` of `replicas` (the
    ready replicas), with requests on `activeReplicas` of them. Written by the autoscaler."""

    name: str
    loaded_replicas: int = 0
    active_replicas: int = 0
    replicas: int = 0


class RevisionClassFigures(_Status):
    """One revision's figures in one prompt-size class over a canary step's window."""

    requests: int = 0
    ttft_median_seconds: float | None = Field(
        default=None, alias="ttftMedianSeconds", description="Streamed answers' median TTFT."
    )
    tpot_median_seconds: float | None = Field(
        default=None, description="Streamed answers' median time per output token."
    )


class RevisionFigures(_Status):
    """One revision's figures over a canary step's window (from the gateway's counters)."""

    requests: int = 0
    errors: int = 0
    slo_met: int = Field(default=0, alias="sloMet")
    ttft_seconds: float | None = Field(default=None, description="Mean time to first token.")
    itl_seconds: float | None = Field(default=None, description="Mean inter-token latency.")
    clients: int | None = Field(default=None, description="Distinct clients answered.")
    classes: dict[str, RevisionClassFigures] | None = Field(
        default=None,
        max_length=8,
        description="Per prompt-size class: answers and the streamed answers' medians.",
    )
    mirrored: int | None = Field(
        default=None, description="Mirrored requests compared (the canary's shadow answers)."
    )
    agreement: float | None = Field(
        default=None, description="Share of mirrored requests whose first k tokens agree."
    )
    token_agreement: float | None = Field(
        default=None, description="Share of compared token positions that agree."
    )
    divergence: float | None = Field(
        default=None, description="Mean divergence from the stable answer (nats per token)."
    )
    speedup: float | None = Field(
        default=None,
        description="Stable's median time per output token over the canary's, on mirrored "
        "requests (above 1: the canary is faster).",
    )


class RolloutVerdict(_Status):
    """The analysis' last verdict on the canary, with the figures it was drawn from."""

    result: Literal["Pass", "Fail", "Inconclusive"]
    reason: str
    message: str = ""
    time: str | None = None
    canary: RevisionFigures | None = None
    stable: RevisionFigures | None = None


class RolloutStatus(_Status):
    """Where the rollout stands (written by the operator)."""

    revision: str | None = Field(
        default=None, description="The spec's revision: a hash of the engine identity."
    )
    stable_revision: str | None = None
    canary_revision: str | None = None
    phase: Literal["Stable", "Progressing", "Promoting", "RolledBack"] | None = None
    step: int | None = Field(default=None, description="The current canary step, from 1.")
    steps: int | None = None
    canary_weight: int | None = Field(
        default=None, description="Percent of requests the gateway sends to the canary."
    )
    step_started_at: str | None = Field(
        default=None, description="When the current step's window began (canary ready)."
    )
    baseline: dict[str, Annotated[dict[str, float], Field(max_length=MAX_ENTRIES)]] | None = Field(
        default=None,
        max_length=MAX_ENTRIES,
        description="The gateway's cumulative counters per revision when the window began.",
    )
    verdict: RolloutVerdict | None = None
    message: str | None = None
    rolled_back_reason: str | None = Field(
        default=None, description="Why the canary was rolled back (a condition reason)."
    )
    last_step_weight: int | None = Field(
        default=None, description="While promoting: the canary's weight at its last step."
    )
    shadow: RolloutShadow | None = Field(
        default=None,
        description="While a step runs: the mirror the gateways run (spec.rollout.shadow).",
    )


class PrefillStatus(_Status):
    """The prefill role's Deployment as observed (the decode role's are status.replicas and
    status.readyReplicas)."""

    replicas: int | None = Field(default=None, description="Desired prefill replicas.")
    ready_replicas: int | None = None


class LLMDeploymentStatus(_Status):
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    replicas: int | None = None
    ready_replicas: int | None = None
    observed_generation: int | None = None
    selector: str | None = None
    capacity: Capacity | None = None
    autoscaler: AutoscalerStatus | None = None
    adapters: list[AdapterStatus] | None = Field(
        default=None,
        max_length=MAX_ADAPTERS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Each adapter of spec.adapters: on how many ready replicas it is loaded "
        "(written by the autoscaler).",
    )
    rollout: RolloutStatus | None = None
    prefill: PrefillStatus | None = Field(
        default=None, description="The prefill role's replicas (with spec.prefill)."
    )


class ObjectMeta(BaseModel):
    """The part of metadata kubellm reads; everything else is kept as is."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    namespace: str = "default"


# Rules on the whole object: they read metadata.name (the API server lets root-level rules
# read metadata.name), so the CRD carries them at the root of its schema.
ROOT_RULES = (
    Rule(
        "!has(self.spec.adapters) || self.spec.adapters.all(a, a.name != "
        "(has(self.spec.model.servedName) ? self.spec.model.servedName : self.metadata.name))",
        "spec.adapters names must differ from the served model name (spec.model.servedName, "
        "or metadata.name when it is unset)",
        ".spec.adapters",
    ),
)


class LLMDeployment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    api_version: Literal["kubellm.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["LLMDeployment"]
    metadata: ObjectMeta
    spec: LLMDeploymentSpec
    status: LLMDeploymentStatus | None = None

    @model_validator(mode="after")
    def _check_root_rules(self) -> LLMDeployment:
        data = {
            "metadata": {"name": self.metadata.name},
            "spec": self.spec.model_dump(by_alias=True, exclude_none=True, mode="json"),
        }
        for rule in ROOT_RULES:
            if not cel.holds(rule.expression, data):
                raise ValueError(rule.message)
        return self

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.metadata.name
