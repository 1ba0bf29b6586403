"""Tenants and their shares: who sent a request (`tenants`), the order waiting requests
dispatch in and which is shed (`queues`), the budgets (`quota`), and `controller.Tenancy`,
the one object the scheduler and the ticket call for all of it. The `--tenants` flags are
in `flags`; what a request may cost and what it cost is read by `protocol/usage.py`."""
