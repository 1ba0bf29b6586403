"""`python -m bench.slo_real_engines` runs bench/gateway/slo_real_engines.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.slo_real_engines", run_name="__main__", alter_sys=True)
