"""kubellm.gateway: the OpenAI-compatible endpoint, prefix-aware routing and overflow fallback."""
