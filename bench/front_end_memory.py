"""`python -m bench.front_end_memory` runs bench/gateway/front_end_memory.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.front_end_memory", run_name="__main__", alter_sys=True)
