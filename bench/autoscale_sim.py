"""`python -m bench.autoscale_sim` runs bench/autoscaler/autoscale_sim.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.autoscaler.autoscale_sim", run_name="__main__", alter_sys=True)
