"""`python -m bench.fluid_bound` runs bench/autoscaler/fluid_bound.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.autoscaler.fluid_bound", run_name="__main__", alter_sys=True)
