"""The standalone HTTP front end: the OpenAI-compatible proxy in front of the replicas."""
