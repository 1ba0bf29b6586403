"""kubellm.operator: reconciles LLMDeployments into engine Deployments, Services and status."""
