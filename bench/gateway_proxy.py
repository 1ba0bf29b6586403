"""`python -m bench.gateway_proxy` runs bench/gateway/proxy.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.proxy", run_name="__main__", alter_sys=True)
