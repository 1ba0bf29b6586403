"""The gates of the admission pass (`routing/dispatch.py`), one module each: adapters
(loads, placement), flow (tenancy: fairness, headroom, the prefill hold), slo (predicted
TTFT, the latency model's feedback)."""
