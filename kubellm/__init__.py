"""kubellm: a Kubernetes control plane for self-hosted LLM fleets.

This package is the shared core (API models, CRD generation, capacity
arithmetic, the engine metrics contract, the CLI). Components live in
subpackages mapped from their own folders: `kubellm.operator` (operator/),
`kubellm.gateway` (gateway/), `kubellm.autoscaler` (autoscaler/) and
`kubellm.engine` (engine_image/). They import the core, never each other.
"""

__version__ = "0.1.0"
