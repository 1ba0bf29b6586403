"""`python -m bench.slo_routing` runs bench/gateway/slo_routing.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.slo_routing", run_name="__main__", alter_sys=True)
