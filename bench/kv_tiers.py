"""`python -m bench.kv_tiers` runs bench/simulation/kv_tiers.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.simulation.kv_tiers", run_name="__main__", alter_sys=True)
