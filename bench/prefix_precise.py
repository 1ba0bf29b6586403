"""`python -m bench.prefix_precise` runs bench/gateway/prefix_precise.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.prefix_precise", run_name="__main__", alter_sys=True)
