"""The engine metrics contract: the Prometheus names the control plane reads.

vLLM exports these; the simulated engine exports the same names. The gateway
routes on them, the autoscaler scales on them, the alerts watch them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # a fraction in [0, 1], despite the name
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"  # tokens looked up
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"  # tokens found cached
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"  # histogram
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"  # histogram
# Counters of tokens processed (prompt) and generated: a replica's progress (the gateway's
# stall watch on answers forwarded whole reads them).
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
# Prompt tokens by where they came from (label `source`): `local_compute` (prefilled here),
# `local_cache_hit`, `external_kv_transfer`; PROMPT_TOKENS counts all three.
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
COMPUTED_SOURCE = "local_compute"
# Per request, first scheduled to first token (a histogram, observed when it finishes):
# with the computed prompt tokens, the replica's prefill speed (the gateway's prefill budget
# learns it).
PREFILL_TIME = "vllm:request_prefill_time_seconds"
# With LoRA on: a gauge set to the time of its last update, one series per label set
# max_lora, running_lora_adapters and waiting_lora_adapters (comma-joined names); older
# label sets stay exported with older times, so the current one has the largest value.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"

ENGINE_METRICS: tuple[str, ...] = (
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    KV_CACHE_USAGE,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    PREFILL_TIME,
    PROMPT_TOKENS_BY_SOURCE,
)

# The gateway's own metrics (names shared with the autoscaler, alerts and dashboards).
# Labels: model (served name), deployment (LLMDeployment name), namespace.
GATEWAY_REQUESTS = "kubellm_gateway_requests_total"  # + target=replica|fallback, code
GATEWAY_PENDING = "kubellm_gateway_pending_requests"  # gauge: admitted, not yet answered
GATEWAY_TTFT = "kubellm_gateway_time_to_first_token_seconds"  # histogram
GATEWAY_ITL = "kubellm_gateway_inter_token_latency_seconds"  # histogram
GATEWAY_E2E = "kubellm_gateway_request_duration_seconds"  # histogram
GATEWAY_FALLBACK = "kubellm_gateway_fallback_requests_total"  # + reason
GATEWAY_GOODPUT = "kubellm_gateway_slo_met_requests_total"  # requests meeting TTFT and ITL
GATEWAY_READY_ENDPOINTS = "kubellm_gateway_ready_endpoints"  # gauge per model
GATEWAY_QUEUE_WAIT = "kubellm_gateway_queue_wait_seconds"  # histogram: admission wait
GATEWAY_PREFIX_MATCH = "kubellm_gateway_prefix_match_ratio"  # histogram: routed prefix match
# Per-deployment SLO settings as series, so recording rules can compute SLIs per deployment.
# kind="ttft"|"itl"; le = the histogram bucket boundary at (or just under) the target.
GATEWAY_SLO_TARGET = "kubellm_gateway_slo_target_seconds"  # gauge
GATEWAY_SLO_OBJECTIVE = "kubellm_gateway_slo_objective"  # gauge
GATEWAY_FALLBACK_TOKENS = "kubellm_gateway_fallback_tokens_total"  # + kind=prompt|completion
# Per LoRA adapter (+ adapter): requests by how they were placed (route=resident: a replica
# had it; loaded: loaded for it first; fallback; refused), and loads the gateway asked for
# (+ outcome=ok|error|timeout) with their duration.
GATEWAY_ADAPTER_REQUESTS = "kubellm_gateway_adapter_requests_total"
GATEWAY_ADAPTER_LOADS = "kubellm_gateway_adapter_loads_total"
GATEWAY_ADAPTER_LOAD_SECONDS = "kubellm_gateway_adapter_load_seconds"  # histogram
# Per revision of a model during a canary rollout (+ revision, the endpoint's
# kubellm.io/revision; the stable one's too): what the operator's canary analysis reads.
# Requests answered by a replica of the revision (+ outcome=ok|error), those that met both
# SLO targets, and TTFT / ITL histograms (the analysis compares means: _sum / _count).
GATEWAY_REVISION_REQUESTS = "kubellm_gateway_revision_requests_total"
GATEWAY_REVISION_SLO_MET = "kubellm_gateway_revision_slo_met_requests_total"
GATEWAY_REVISION_TTFT = "kubellm_gateway_revision_time_to_first_token_seconds"
GATEWAY_REVISION_ITL = "kubellm_gateway_revision_inter_token_latency_seconds"
GATEWAY_REVISION_CLASS_REQUESTS = "kubellm_gateway_revision_class_requests_total"
GATEWAY_REVISION_CLIENTS = "kubellm_gateway_revision_clients_total"
GATEWAY_REVISION_STREAM_TTFT = "kubellm_gateway_revision_stream_ttft_seconds"
GATEWAY_REVISION_TPOT = "kubellm_gateway_revision_time_per_output_token_seconds"
# The shadow step's mirror (gateway/routing/canary/mirror.py), per canary revision and class.
GATEWAY_MIRROR_REQUESTS = "kubellm_gateway_mirror_compared_total"
GATEWAY_MIRROR_SHED = "kubellm_gateway_mirror_shed_total"
GATEWAY_MIRROR_AGREED = "kubellm_gateway_mirror_agreed_total"
GATEWAY_MIRROR_TOKENS = "kubellm_gateway_mirror_tokens_total"
GATEWAY_MIRROR_TOKENS_AGREED = "kubellm_gateway_mirror_tokens_agreed_total"
GATEWAY_MIRROR_DIVERGENCE = "kubellm_gateway_mirror_divergence_nats"
GATEWAY_MIRROR_TPOT = "kubellm_gateway_mirror_time_per_output_token_seconds"
GATEWAY_MIRROR_STABLE_TPOT = "kubellm_gateway_mirror_stable_time_per_output_token_seconds"
# Process-wide health of the gateway itself (no model labels).
# One series per engine endpoint the gateway knows: state=ready|draining|ejected|down, value 1
# (diagnose and dashboards find a gateway's engines here, without being told their ports).
GATEWAY_ENDPOINT_INFO = "kubellm_gateway_endpoint_info"
# gauge per endpoint url: this front end's requests there now (read when scraped: no cost
# per request); an endpoint with none has no series
GATEWAY_ENDPOINT_IN_FLIGHT = "kubellm_gateway_endpoint_in_flight"
GATEWAY_CONNECTIONS_REFUSED = "kubellm_gateway_connections_refused_total"  # over the cap
GATEWAY_CONFIG_RELOAD_ERRORS = "kubellm_gateway_config_reload_errors_total"  # static file
# Per tenant (issue 26; tenants are declared, so the label is bounded): requests by route
# and code, tokens by route (replica|fallback) and kind (prompt|completion), time waiting for
# admission, answers meeting the SLO, requests dropped by flow control (+ reason) and
# refused by a quota (+ limit=requests|tokens), and TTFT / ITL histograms measured as the
# model's own (GATEWAY_TTFT, GATEWAY_ITL), with their buckets. `kubellm usage` reads these.
GATEWAY_TENANT_REQUESTS = "kubellm_gateway_tenant_requests_total"
GATEWAY_TENANT_TOKENS = "kubellm_gateway_tenant_tokens_total"
GATEWAY_TENANT_QUEUE = "kubellm_gateway_tenant_queue_seconds"  # histogram
GATEWAY_TENANT_GOODPUT = "kubellm_gateway_tenant_slo_met_requests_total"
GATEWAY_TENANT_DROPPED = "kubellm_gateway_tenant_dropped_total"
GATEWAY_TENANT_THROTTLED = "kubellm_gateway_tenant_throttled_total"
GATEWAY_QUOTA_STORE_FAILURES = "kubellm_gateway_quota_store_failures_total"
GATEWAY_TENANT_TTFT = "kubellm_gateway_tenant_time_to_first_token_seconds"  # histogram
GATEWAY_TENANT_ITL = "kubellm_gateway_tenant_inter_token_latency_seconds"  # histogram

# Latency prediction (gateway/routing/latency/predictions.py, routing policy slo-aware learns it
# for every policy): predicted over observed TTFT and ITL per replica (kind=ttft|itl), and
# each replica's speed against its peers' median at the same batch and prompt.
GATEWAY_PREDICTION_RATIO = "kubellm_gateway_predicted_over_observed_ratio"  # histogram
GATEWAY_SPEED_FACTOR = "kubellm_gateway_replica_speed_factor"  # gauge per url
# Prefill/decode disaggregation (spec.prefill): each request's split decision by reason
# (+ split=true|false), each leg's outcome by role (+ role=prefill|decode, outcome), the
# prefill leg's seconds, and the KV transfer's seconds as predicted (bytes / link bandwidth)
GATEWAY_DISAGG_DECISIONS = "kubellm_gateway_disagg_decisions_total"
GATEWAY_DISAGG_LEGS = "kubellm_gateway_disagg_legs_total"
GATEWAY_DISAGG_PREFILL = "kubellm_gateway_disagg_prefill_seconds"  # histogram
GATEWAY_DISAGG_TRANSFER = "kubellm_gateway_disagg_transfer_seconds"  # histogram


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets; None
    when the histogram is empty. The one implementation (fleet status, diagnose)."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] == 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass(frozen=True)
class LoraInfo:
    """One replica's `vllm:lora_requests_info`: its slot count, running and waiting adapters."""

    max_lora: int
    running: frozenset[str]
    waiting: frozenset[str]


def parse_lora_info(text: str) -> LoraInfo | None:
    """The current series of `vllm:lora_requests_info` (the one with the latest time: older
    label sets stay exported), or None when the engine has LoRA off."""
    best: tuple[float, dict[str, str]] | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == LORA_REQUESTS_INFO and (best is None or sample.value > best[0]):
                best = (sample.value, sample.labels)
    if best is None:
        return None
    labels = best[1]

    def names(key: str) -> frozenset[str]:
        return frozenset(n for n in labels.get(key, "").split(",") if n)

    try:
        slots = int(labels.get("max_lora", "0"))
    except ValueError:
        slots = 0
    return LoraInfo(slots, names("running_lora_adapters"), names("waiting_lora_adapters"))
