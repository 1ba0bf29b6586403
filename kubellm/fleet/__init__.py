"""`kubellm up`: the whole control plane on one machine, without Kubernetes."""
