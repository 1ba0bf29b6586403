"""The fleet simulation behind bench/autoscale_sim.py: traces, the simulated fleet, the report."""
