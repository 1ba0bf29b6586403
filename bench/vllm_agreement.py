"""`python -m bench.vllm_agreement` runs bench/engine/vllm_agreement.py."""

import runpy

if __name__ == "__main__":
    runpy.run_module("bench.engine.vllm_agreement", run_name="__main__", alter_sys=True)
