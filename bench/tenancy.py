"""`python -m bench.tenancy` runs bench/gateway/tenancy.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.tenancy", run_name="__main__", alter_sys=True)
