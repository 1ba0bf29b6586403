"""Latency: each replica's TTFT and ITL predicted and learnt (`model`, pure), what this
gateway knows around the model (`predictions`: prefill owed, priors, prediction error), and
the Prometheus series measured where the client feels latency (`metrics`, `histogram`)."""
