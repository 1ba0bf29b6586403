"""The fleet simulation: one LLMDeployment's fleet on a simulated clock.

It composes real parts of three components: the autoscaler's policies and
metrics parsers (`kubellm.autoscaler`), the simulated engine's pure model
(`kubellm.engine.sim_core`) and the gateway's admission decision
(`kubellm.gateway.routing.admission`). Like `kubellm.fleet` (the local fleet
`kubellm up` assembles from processes) it is a composition of components, so
it may import them; no component imports it, and the core does not either
(import-linter checks both). The benchmark (`bench/autoscaler/autoscale_sim.py`) and the
planning command (`kubellm plan --trace`, `plan.py`) both run this one module,
so the command's figures are the benchmark's for the same inputs.

Modules: `traces` (seeded and recorded request traces), `fleet` (the
discrete-event simulation), `gateway` (the gateway's admission and the
modelled fallback API), `experiment` (the fleet, spec, prices and one run's
figures), `report` (tables, targets, plots), `plan` (the command).
"""
