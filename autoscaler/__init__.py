"""kubellm.autoscaler: replicas from KV-cache occupancy and queue depth, via /scale."""
