"""Routing plugins: filters and scorers, composed by weights into a picker.

Each scorer lives in its own module and returns, for one request and the
candidate endpoints, a score in [0, 1] per candidate. `picker` composes them
into the three policies of `spec.routing.policy`.
"""
