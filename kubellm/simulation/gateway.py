"""The gateway's admission and fallback, as the fleet simulation runs them.

The admission decision is production's own: `decide`, `saturated`,
`predicted_wait` and `CompletionRate` (on the simulated clock), imported from
the gateway in this one place. The gateway's routing moved from
`kubellm.gateway.fallback` to `kubellm.gateway.routing.admission`; either
path works. The bench is not a component, so it may import the gateway.

What the simulation adds around it (`Admission` in fleet.py drives it):
- the loop of `admit`: a request that `decide` queues waits in the gateway's
  queue and is decided again whenever a replica finishes a step that freed
  a slot, a fallback request ends, or half a second passes (production waits
  for a load-view change or 0.5 s);
- the fallback API's latency (`ApiModel`): a modelled TTFT and ITL, flags with
  documented defaults; a request served there meets the SLO when the wait in
  the gateway plus the API's TTFT meets the TTFT target and the API's ITL the
  ITL target.
"""

from __future__ import annotations

from dataclasses import dataclass

try:  # the gateway's routing package (since the request-path hardening)
    from kubellm.gateway.routing import admission as _admission
except ImportError:  # before the move
    from kubellm.gateway import fallback as _admission  # type: ignore[no-redef]

Candidate = _admission.Candidate
CompletionRate = _admission.CompletionRate
FallbackTarget = _admission.FallbackTarget
Route = _admission.Route
Thresholds = _admission.Thresholds
decide = _admission.decide
predicted_wait = _admission.predicted_wait
saturated = _admission.saturated

# The gateway's defaults (kubellm gateway's settings), mirrored for the simulation.
MAX_QUEUE = 256  # waiting requests per model
RECHECK_SECONDS = 0.5  # a queued request looks again at least this often
COMPLETION_WINDOW = 10.0  # CompletionRate's default window


@dataclass(frozen=True)
class ApiModel:
    """The fallback API's latency and price per million tokens (input, output).

    Defaults: a hosted API serving a model of the same class (an 8B model):
    time to first token 0.6 s for a ~2,400-token prompt, 25 ms between
    tokens (40 tokens/s per stream), $0.20 per million tokens in and out.
    """

    ttft_seconds: float = 0.6
    itl_seconds: float = 0.025
    input_price_per_million: float = 0.20
    output_price_per_million: float = 0.20
    max_concurrency: int = 64  # spec.fallback.maxConcurrency's default

    def duration(self, output_tokens: int) -> float:
        return self.ttft_seconds + self.itl_seconds * max(0, output_tokens - 1)

    def cost(self, prompt_tokens: float, output_tokens: float) -> float:
        return (
            prompt_tokens * self.input_price_per_million
            + output_tokens * self.output_price_per_million
        ) / 1e6

    def target(self) -> object:
        """The gateway's view of the fallback: the production `FallbackTarget`."""
        return FallbackTarget(
            url="http://fallback.invalid/v1", max_concurrency=self.max_concurrency
        )
