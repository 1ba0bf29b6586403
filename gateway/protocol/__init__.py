"""Wire formats the gateway speaks: OpenAI's request bodies (`openai`), error envelope and
SSE error events (`errors`), the `usage` figures and token bounds of a request and its
answer (`usage`), a streamed answer assembled into one (`assemble`), repeated headers
(`headers`)."""
