"""The routing core's settings: one type for both front ends, built once (from the
command line: `routing/flags.py`; embedded: the local fleet), each default stated here
once. Per-model settings (policy, load bound, SLO, timeouts) come from discovery, not
from here. Light to import: the CLI reads these defaults before any component loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubellm.gateway.routing.flow.controller import TenancySettings


@dataclass(frozen=True)
class Thresholds:
    """When a replica counts as saturated (admission.saturated)."""

    # engine queue depth (the autoscaler's default targetQueueDepth, so overflow reaches
    # the fallback before the queue asks for a replica; docs/autoscaling.md)
    max_waiting: float = 4.0
    max_kv_usage: float = 0.95  # KV-cache usage
    max_in_flight: int | None = None  # requests this gateway has on it (None: no cap)


@dataclass(frozen=True)
class FlowSettings:
    """Flow control: the queues per priority band and tenant (`flow/queues.py`)."""

    max_band: int = 5000  # waiters per band and model (llm-d's default)
    max_total: int = 5000  # waiters per model, all bands
    ttl_seconds: float = 60.0  # the longest wait of a sheddable request (llm-d's default)
    headroom_below: int = 0  # bands below this dispatch only under the lower line
    headroom_kv: float = 0.8
    headroom_load: float | None = None  # requests per replica; None: learnt (`Flow.learn`)
    # without headroom_load: this share of each replica's slots, learnt from its scrapes,
    # is kept free of sheddable work (12 of maxNumSeqs 16)
    headroom_reserve: float = 0.25
    # a replica where a high-band stream awaits its first token takes no low band meanwhile
    hold_prefill: bool = True
    # low-band prompt tokens per second a replica is sent at most (None: no bound)
    headroom_prefill_rate: float | None = None
    # without headroom_prefill_rate: each replica's prefill speed learnt from its scrapes,
    # while a band at or above headroom_below is about (`gates/flow.py`); False: no bound
    headroom_prefill_learnt: bool = True
    # service tokens (prompt + 2 x output) in flight per replica that a band's tenants
    # share while more than one is active (None: derived, `flow/queues.py` fair_capacity)
    fair_in_flight_tokens: float | None = None
    fair_in_flight: bool = True  # False: no fair in-flight budget


@dataclass
class SchedulerSettings:
    """Admission, health and routing knobs shared by every model of one process."""

    thresholds: Thresholds = field(default_factory=Thresholds)
    max_queue: int = 256  # waiting requests per model
    zero_replica_wait_seconds: float = 60.0  # queue budget while a model has no replica
    retry_after_seconds: int = 1  # the Retry-After of a refusal (429 saturated, 503 none)
    scrape_interval: float = 1.0  # seconds between engine scrapes
    stale_after: float = 5.0  # scraped figures older than this count as unknown
    # How many front ends (gateway or endpoint-picker replicas) share each model's traffic.
    # Over 1, a front end that knows no holder of a prompt presumes its home holds it (the
    # holders' wider load bound there): another front end may have sent the prefix home.
    # At 1 it knows every holder it made, and presuming one for every unseen prompt keeps
    # unique prompts queued at their homes (bench/gateway/slo_routing.py, mixed pool, prefix-aware:
    # 90%-rate 42.4 req/s without the presumption, 25.2 with it).
    front_ends: int = 1
    eject_after_failures: int = 3
    eject_base_seconds: float = 5.0
    # LoRA (routing/replicas/adapters.py): prefer replicas with the adapter in a slot (False:
    # adapter-blind, for comparison), and how many adapter loads may run at once
    adapter_affinity: bool = True
    max_adapter_loads: int = 2
    # spec.routing.prefixIndex precise: each model's tokenizer (served name -> a local
    # directory or a Hugging Face id), to hash prompts as its engines do
    # (routing/index/precise_routing.py)
    tokenizers: dict[str, str] = field(default_factory=dict)
    # tenants, flow control and quotas (routing/flow/controller.py); None: every request alike
    tenancy: TenancySettings | None = None
