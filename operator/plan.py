"""Pure planning: desired children vs observed children -> what to write.

The reconciler observes, calls `plan`, then executes the actions; this module
does no I/O, so every case (missing, drifted, unchanged, no longer wanted,
owned by someone else) is a table test.

"Unchanged" is judged the way server-side apply sees it: every field the
operator sets must hold the same value on the live object; fields the API
server or other controllers add (defaults, status, annotations) are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

# scale: set only spec.replicas (the stable Deployment during a canary rollout, whose
# template the operator leaves as it is).
Verb = Literal["create", "update", "delete", "scale"]


@dataclass(frozen=True, order=True)
class Ref:
    """Identity of one child object."""

    api_version: str
    kind: str
    namespace: str
    name: str

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Ref:
        meta = obj["metadata"]
        return cls(obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


@dataclass(frozen=True)
class Action:
    verb: Verb
    ref: Ref
    body: Mapping[str, Any] | None = None  # the desired object, for create and update
    replicas: int | None = None  # for scale


@dataclass(frozen=True)
class Plan:
    actions: list[Action] = field(default_factory=list)
    unchanged: list[Ref] = field(default_factory=list)
    # Objects with a child's name that this LLMDeployment does not control: left alone.
    conflicts: list[Ref] = field(default_factory=list)

    @property
    def writes(self) -> int:
        return len(self.actions)


def controlled_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == owner_uid and r.get("controller") for r in refs)


def plan(
    desired: Sequence[Mapping[str, Any]],
    observed: Mapping[Ref, Mapping[str, Any] | None],
    owner_uid: str,
) -> Plan:
    """Create what is missing, update what drifted, delete owned children no longer wanted.

    `observed` maps every child the operator might own to its live object, or
    None when absent; children of `desired` missing from `observed` count as absent.
    """
    result = Plan()
    wanted = set()
    for body in desired:
        ref = Ref.of(body)
        wanted.add(ref)
        live = observed.get(ref)
        if live is None:
            result.actions.append(Action("create", ref, body))
        elif not controlled_by(live, owner_uid):
            result.conflicts.append(ref)
        elif contains(body, live):
            result.unchanged.append(ref)
        else:
            result.actions.append(Action("update", ref, body))
    for ref, live in sorted(observed.items()):
        if ref not in wanted and live is not None and controlled_by(live, owner_uid):
            result.actions.append(Action("delete", ref))
    return result


# --------------------------------------------------------------------------- comparison


_QUANTITY = re.compile(
    r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$"
)
_SUFFIX = {
    None: Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
    **{s: Decimal(2 ** (10 * (i + 1))) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
}


def quantity(value: str) -> Decimal | None:
    """A Kubernetes resource quantity as a number ('500m' -> 0.5, '1Gi' -> 2**30), else None."""
    match = _QUANTITY.match(value)
    if not match:
        return None
    try:
        return Decimal(match.group(1)) * _SUFFIX[match.group(2)]
    except InvalidOperation:
        return None


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have and type(want) is type(have):
        return True
    if isinstance(want, str) and isinstance(have, str):
        a, b = quantity(want), quantity(have)
        return a is not None and a == b  # the API server rewrites '1000m' as '1'
    return False


def _keyed(items: Sequence[Any]) -> bool:
    return bool(items) and all(isinstance(i, Mapping) and "name" in i for i in items)


def contains(want: Any, have: Any) -> bool:
    """Whether `have` (a live object) holds every value of `want` (what we apply).

    Dicts: every key of `want` is in `have` with a contained value. Lists of
    named dicts (containers, ports, volumes, env) match by name, so defaults
    added inside them and entries added by others do not count as drift. Other
    lists match position by position with the same length. Quantities compare
    by value.
    """
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            key in have and contains(value, have[key]) for key, value in want.items()
        )
    if isinstance(want, list):
        if not isinstance(have, list):
            return False
        if _keyed(want) and _keyed(have):
            by_name = {item["name"]: item for item in have}
            return all(
                item["name"] in by_name and contains(item, by_name[item["name"]]) for item in want
            )
        return len(want) == len(have) and all(
            contains(w, h) for w, h in zip(want, have, strict=True)
        )
    return _same_scalar(want, have)
