"""`python -m bench.gateway_real_engines` runs bench/gateway/real_engines.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.real_engines", run_name="__main__", alter_sys=True)
