"""The simulated engine: vLLM's OpenAI API and metrics, driven by a model of one replica.

It is a simulator, and says so everywhere: `owned_by: kubellm-simulator` in
/v1/models, an `x-kubellm-engine: simulator` header on every response, and its
start-up log line. Use it to test the gateway and autoscaler at fleet scale
without GPUs:

    from kubellm.engine.sim import create_app
    app = create_app(served_model_name="m", profile="tiny-cpu", time_scale=0)

- `sim_profiles`: named hardware/model profiles (KV pool, step costs).
- `sim_core`: the pure engine model (paged KV pool, prefix cache, scheduler).
- `sim_tokenizer`: deterministic tokenization (~4 characters per token, or a
  checkpoint's tokenizer.json).
- `sim_runtime`: the asyncio task that steps the core, and its Prometheus metrics.
- `sim_server`: the Starlette app (the OpenAI API) and `serve`.

(Flat modules rather than a subpackage: pyproject lists packages explicitly.)
"""

from kubellm.engine.sim_server import create_app

__all__ = ["create_app"]
