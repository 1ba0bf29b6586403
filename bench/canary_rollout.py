"""`python -m bench.canary_rollout` runs bench/gateway/canary_rollout.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.canary_rollout", run_name="__main__", alter_sys=True)
