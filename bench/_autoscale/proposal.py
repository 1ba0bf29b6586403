"""A bench-only prototype (`kv-queue+rate`): the shipped policy plus a request-rate floor.

Not shipped; it exists to test a proposed change with figures. The shipped
`kv-queue` policy's signals (KV usage, queue depth) read near zero until a
replica is close to saturation and then climb steeply, so at low utilisation
ceil(sum of KV / target) asks for far fewer replicas than the load needs and
the fleet collapses to minReplicas after each scale-down window. Request rate
is proportional to load. This prototype feeds the real `KVQueuePolicy` a
`minReplicas` of ceil(rate / (requests per replica)), with the rate the
gateway's `kubellm_gateway_requests_total` would give over the last 30 s;
windows, step bounds and the other signals stay those of the real policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kubellm.autoscaler import policy as p
from kubellm.autoscaler.kvqueue import KVQueuePolicy

from kubellm import api


@dataclass(frozen=True)
class RateFloorPolicy:
    requests_per_replica: float  # what one replica serves within the SLO
    inner: KVQueuePolicy = field(default_factory=KVQueuePolicy)
    wants_request_rate = True  # the fleet passes `request_rate` to decide()

    def decide(
        self,
        observation: p.Observation,
        state: p.PolicyState,
        spec: api.Autoscaling,
        request_rate: float = 0.0,
    ) -> p.Decision:
        floor = math.ceil(request_rate / self.requests_per_replica - 1e-9)
        floor = min(spec.max_replicas, max(spec.min_replicas, floor))
        return self.inner.decide(
            observation, state, spec.model_copy(update={"min_replicas": floor})
        )
