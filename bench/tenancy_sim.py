"""`python -m bench.tenancy_sim` runs bench/simulation/tenancy_sim.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.simulation.tenancy_sim", run_name="__main__", alter_sys=True)
