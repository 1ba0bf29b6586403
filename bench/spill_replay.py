"""`python -m bench.spill_replay` runs bench/gateway/spill_replay.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.spill_replay", run_name="__main__", alter_sys=True)
