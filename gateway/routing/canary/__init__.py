"""Canary rollouts in the routing core: which revision serves a request (`revisions`, pure)
and the shadow mirror that compares the canary's answers with stable's (`mirror`)."""
