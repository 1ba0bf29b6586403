"""`python -m bench.canary_quality` runs bench/gateway/canary_quality.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.canary_quality", run_name="__main__", alter_sys=True)
