"""Request headers as both front ends read them: one rule for a repeated header.

A header the gateway reads (the key, the tenant and session headers, the request id, the
content type) may arrive more than once. The HTTP gateway and the endpoint picker take the
same value: the **first** one, as Envoy's own header lookup does, so a request cannot be
read one way by one front end and another way by the other (or by a proxy in front that
looks at the first). Names are lower case (ASGI servers and Envoy send them so).
"""

from __future__ import annotations

from collections.abc import Iterable


def first_values(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """(name, value) pairs as a dict: a repeated name keeps its first value."""
    out: dict[str, str] = {}
    for name, value in pairs:
        if name not in out:
            out[name] = value
    return out
