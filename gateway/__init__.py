"""kubellm.gateway: the OpenAI-compatible endpoint, prefix-aware routing and overflow fallback.

Data flow of one request (`app.Gateway.completions`):

1. authenticate (optional sha256-hashed keys), read the body within the size
   limit, check the fields routing relies on (`protocol.errors` for refusals);
2. look the model up in the discovery snapshot (`discovery`: static file,
   Kubernetes, or a fixed/embedded source);
3. admission (`fallback.decide`): replica, fallback API, bounded queue, or 429/503;
4. order the candidates (`router` + `scorers.picker`: health filters, the
   bounded-load filter, weighted scorers per `spec.routing.policy`);
5. forward with retries before the first byte (`proxy`), relay the answer,
   time it, and count it (`slo_metrics`); `load` and `outliers` keep the view
   of each engine that the next request routes on.
"""
