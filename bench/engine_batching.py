"""`python -m bench.engine_batching` runs bench/engine/batching.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.engine.batching", run_name="__main__", alter_sys=True)
