"""`python -m bench.pd_disagg` runs bench/simulation/pd_disagg.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.simulation.pd_disagg", run_name="__main__", alter_sys=True)
