"""`python -m bench.gateway_routing` runs bench/gateway/routing.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.routing", run_name="__main__", alter_sys=True)
