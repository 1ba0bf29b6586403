"""Evaluate the CRD's CEL rules outside the API server, with cel-python.

The expressions are the ones in the generated CRD (see `kubellm.api.Rule`);
this module only compiles and runs them, it never re-implements a rule.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import celpy


@cache
def _env() -> celpy.Environment:
    return celpy.Environment()


@cache
def _program(expression: str) -> Any:
    env = _env()
    return env.program(env.compile(expression))


def holds(expression: str, self_value: Any) -> bool:
    """True when `expression` evaluates to true with `self` bound to `self_value` (JSON)."""
    result = _program(expression).evaluate({"self": celpy.json_to_cel(self_value)})
    if isinstance(result, Exception):  # CELEvalError is returned, not raised
        raise ValueError(f"CEL rule {expression!r} could not be evaluated: {result}")
    return bool(result)
