"""Wire formats the gateway speaks: OpenAI's error envelope and SSE error events."""
