"""Benchmarks of the engine: vLLM on CPU and the simulated engine."""
