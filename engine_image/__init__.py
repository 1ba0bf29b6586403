"""kubellm.engine: the engine image, the vLLM launcher, the simulator, the tiny checkpoint."""
