"""Shared fixtures: engines (real vLLM on CPU, the simulator, the tiny checkpoint)."""

pytest_plugins = ["tests.fixtures.engines", "tests.fixtures.fleets", "tests.fixtures.redis"]
