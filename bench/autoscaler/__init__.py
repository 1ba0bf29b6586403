"""Benchmarks of the autoscaler's policies on simulated traces, and their bounds."""
