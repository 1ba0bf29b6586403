"""Benchmarks of the gateway: its proxy cost, routing, tenancy, SLO routing, canary."""
