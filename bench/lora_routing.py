"""`python -m bench.lora_routing` runs bench/gateway/lora_routing.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.gateway.lora_routing", run_name="__main__", alter_sys=True)
