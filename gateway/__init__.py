"""kubellm.gateway: the OpenAI-compatible endpoint, prefix-aware routing and overflow fallback.

One routing core (`routing`), two front ends over it (`http`, the standalone proxy; `epp`,
the Inference Extension's endpoint picker for Envoy-based gateways), shared discovery and
protocol. Data flow of one request through the HTTP front end (`http.app.Gateway.serve`):

1. authenticate (optional sha256-hashed keys), read the body within its size and time
   limits, check it (`protocol.openai`; `protocol.errors` for refusals);
2. look the model up in the discovery snapshot (`discovery`: static file, Kubernetes,
   or a fixed/embedded source);
3. admission (`routing.scheduler.Scheduler.admit` around `routing.admission.decide`)
   returns the request's ticket (`routing.lifecycle.Ticket`): replica, fallback API,
   bounded queue, or the core's 429/503; candidates ordered by `routing.router` and the
   declared profile of `spec.routing.policy` (`routing.profiles`: health filters, the
   bounded-load filter, weighted scorers);
4. forward with retries until a replica's first byte (`http.relay`, each try a
   `ticket.attempt`, over the llhttp-framed client `http.upstream`), relay the answer
   through `ticket.chunk`, and `ticket.finish` counts it once (`routing.latency.metrics` series);
   `routing.replicas.load` and `routing.replicas.outliers` keep the view of each engine the next
   request routes on. The endpoint picker (`epp.server.Exchange`) makes the same calls from
   ext_proc messages.
"""
