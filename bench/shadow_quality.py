"""`python -m bench.shadow_quality` runs bench/gateway/shadow_quality.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.shadow_quality", run_name="__main__", alter_sys=True)
