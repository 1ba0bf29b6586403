"""The benchmarks, laid out like the product:

- `bench/gateway/`: the gateway's proxy cost, routing, tenancy, SLO routing and canary;
- `bench/engine/`: vLLM on CPU and the simulated engine;
- `bench/autoscaler/`: the autoscaler's policies on simulated traces, and their bounds;
- `bench/simulation/`: fleet simulations of the routing core (KV tiers, P/D, tenancy);
- `bench/_fleet.py` (ports, health waits, core pins), `bench/_client.py` (the streamed
  OpenAI client): what they all share.

Each top-level `bench/x.py` is a thin entry point, run from the repository root as
`python -m bench.x [flags]` (`--help` says what it measures); its docstring names the module
that holds the benchmark. Modules import each other absolutely (`bench.gateway.routing`):
`python -m` puts the repository root on the path, as pytest's `pythonpath` does for the
tests that import a benchmark's pure parts.
"""
