"""The pieces of bench/gateway/proxy.py: the backend and the relay (programs of their own,
run as scripts in their own processes), the load generator, the paths measured (the
gateway, Envoy, vllm-router, Envoy + the endpoint picker, each pinned to a core) and the
report."""
