"""Fleet simulations of the routing core (KV tiers, P/D, tenancy) on simulated clocks."""
