"""`python -m bench.sim_throughput` runs bench/engine/sim_throughput.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.engine.sim_throughput", run_name="__main__", alter_sys=True)
