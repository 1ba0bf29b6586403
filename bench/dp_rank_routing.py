"""`python -m bench.dp_rank_routing` runs bench/gateway/dp_rank_routing.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.dp_rank_routing", run_name="__main__", alter_sys=True)
