"""Where the gateway learns which models exist and which engines serve them.

Every source (a static file, the Kubernetes API, the local fleet) implements
the small `Discovery` interface in `base`: a current snapshot of
served model name -> `ModelTarget`, and a coroutine that keeps it current.
"""

from kubellm.gateway.discovery.base import (
    Discovery,
    Endpoint,
    FallbackTarget,
    FixedDiscovery,
    ModelTarget,
    StepCosts,
)

__all__ = ["Discovery", "Endpoint", "FallbackTarget", "FixedDiscovery", "ModelTarget", "StepCosts"]
