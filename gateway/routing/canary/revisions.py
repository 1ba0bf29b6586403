"""Which revision serves a request while a canary rollout runs (pure).

During a canary step the LLMDeployment's status says the canary revision and its weight
(percent); discovery carries both (`ModelTarget.canary`) and each endpoint's revision
(`Endpoint.revision`, None for the stable one). A request goes to the canary when its
key falls in the canary's share of a fixed hash space:

    canary  iff  bucket(key) < weight x 100,   bucket(key) = SHA-256(key) mod 10,000

The key is the request's session (the `x-session-id` header or the body's `user`), else
its whole prompt (a hash of its text; the prefix chunks leave a prompt's tail out), else
its home key. So a session
stays on one revision; every gateway replica agrees without shared state; and as the
weight grows, keys already on the canary stay there (the share only adds keys). A hot
prefix (one system prompt before every long prompt) does not move as one: its prompts
split by weight, so the canary sees the request classes the model serves, at the cost of
that prefix's KV cache being built once on each revision.

The analysis' figures (operator/rollout.py) are counted per prompt-size class
(`size_class`) and per client (`client_key`: the tenant where tenants are declared, else
the split key): `slo.Ledger` counts at most `CLIENT_CAP` answers of one client per revision
and step in the latency figures, and how many distinct clients each revision answered.

Weight 0 (rolled back) sends nothing to the canary; when the chosen side has no candidate
(the canary is not ready yet, or a revision's replicas are all ejected), the other side
serves, so the split never fails a request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from kubellm.gateway.discovery.base import CanarySplit, ModelTarget
from kubellm.gateway.routing.latency.metrics import STABLE_REVISION
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest
from kubellm.gateway.routing.scorers.prefix import prompt_text

if TYPE_CHECKING:
    from kubellm.gateway.routing.latency.metrics import GatewayMetrics, RequestRecord

BUCKETS = 10_000

C = TypeVar("C")


def bucket(key: str) -> int:
    """Where `key` falls in [0, BUCKETS): the same on every gateway and every run."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % BUCKETS


def request_key(request: RoutingRequest) -> str:
    """The key a request sticks to a revision by: its session, else its whole prompt (a
    hot prefix's prompts split by weight), else its prompt's home."""
    if request.session:
        return f"session:{request.session}"
    if request.body is not None:  # the whole prompt: its tail too (chunks leave it out)
        text = prompt_text(dict(request.body))
        return f"prompt:{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if request.chunk_hashes:
        return f"prompt:{request.chunk_hashes[-1]}"
    if request.affinity_key is not None:
        return f"prefix:{request.affinity_key}"
    return ""


def to_canary(key: str, weight: int) -> bool:
    """Whether `key` goes to a canary taking `weight` percent."""
    if weight <= 0:
        return False
    if weight >= 100:
        return True
    return bucket(key) < weight * (BUCKETS // 100)


def choose(
    items: Sequence[C], revision_of: Mapping[int, str | None], split: CanarySplit | None, key: str
) -> list[C]:
    """The items (candidates, by position) of the revision `key` goes to; all of them with
    no split; the other side's when the chosen side has none. `revision_of` maps an item's
    position to its endpoint's revision (None: stable). In the shadow step (weight 0, a
    mirror share) only the stable ones, even when there are none."""
    if split is None:
        return list(items)
    canary = [item for i, item in enumerate(items) if revision_of.get(i) == split.revision]
    stable = [item for i, item in enumerate(items) if revision_of.get(i) != split.revision]
    wanted, other = (canary, stable) if to_canary(key, split.weight) else (stable, canary)
    if split.weight <= 0 and split.shadow_share > 0:
        return stable  # the shadow step: the canary answers mirrored requests only
    return wanted or other


def last_resort(target: ModelTarget) -> bool:
    """Whether a request's retries may reach the other revision's replicas once every one
    of its own failed (an outage of one side costs no answer): yes, but not in the shadow
    step, whose canary must not answer a client before its verdict."""
    split = target.canary
    return split is None or not (split.weight <= 0 and split.shadow_share > 0)


def revision_label(target: ModelTarget, url: str) -> str | None:
    """The `revision` label of an answer from `url` while the model's traffic is split
    (the endpoint's revision, "stable" for the others); None when no rollout splits it."""
    if target.canary is None:
        return None
    for endpoint in target.endpoints:
        if endpoint.url == url:
            return endpoint.revision or STABLE_REVISION
    return STABLE_REVISION


def revisions_failed(metrics: GatewayMetrics, targets: Iterable[ModelTarget], url: str) -> None:
    """An attempt on `url` failed before its first byte (the gateway retries it elsewhere):
    while a canary splits the model, count it as an error of the endpoint's revision, so a
    revision that answers 5xx is seen by the analysis even when a retry saved the request."""
    if metrics.revisions is None:
        return
    for target in targets:
        if target.canary is not None and any(e.url == url for e in target.endpoints):
            names = (target.served_name, target.deployment, target.namespace)
            revision = revision_label(target, url) or STABLE_REVISION
            metrics.revisions.requests.labels(*names, revision, "error").inc()


def for_request(
    target: ModelTarget, request: RoutingRequest, candidates: Sequence[Candidate]
) -> list[Candidate]:
    """The router's hook: `candidates` narrowed to the revision this request goes to."""
    if target.canary is None:
        return list(candidates)
    revisions = {e.url: e.revision for e in target.endpoints}
    by_position = {i: revisions.get(c.url) for i, c in enumerate(candidates)}
    return choose(candidates, by_position, target.canary, request_key(request))


# --------------------------------------------------------------------------- analysis figures

# Prompt-size classes (characters, about 4 per token): like is compared with like.
SIZE_CLASSES = (("short", 2_000), ("medium", 16_000), ("long", None))


def size_class(prompt_chars: int) -> str:
    """The prompt-size class of a prompt of `prompt_chars` characters."""
    for name, below in SIZE_CLASSES:
        if below is None or prompt_chars < below:
            return name
    return SIZE_CLASSES[-1][0]


def client_key(request: RoutingRequest, tenant: str | None) -> str:
    """Who a request counts as in the analysis: its tenant (a declared, authenticated
    identity a client cannot multiply), else the key it was split by."""
    return f"tenant:{tenant}" if tenant else request_key(request)


def attribute(
    record: RequestRecord,
    target: ModelTarget,
    url: str,
    request: RoutingRequest,
    tenant: str | None,
) -> None:
    """An attempt goes to `url`: the request's record counts in that endpoint's revision,
    with its step, client and prompt-size class while a canary splits the model."""
    record.revision = revision_label(target, url)
    split = target.canary
    if record.revision is None or split is None:
        record.sample = None
        return
    step = (target.served_name, record.revision, split.revision, split.weight)
    record.sample = (step, client_key(request, tenant), size_class(request.prompt_chars))
