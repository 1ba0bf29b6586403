"""Tenants: who sends a request, and what that team may have.

A tenant has a name, API keys (kept as sha256 digests, as `--api-keys-file` keeps them), a
priority (an integer, higher first; negative means sheddable, as the Inference Extension's
InferenceObjective priority), a fair-share weight, optional `tokensPerMinute` /
`requestsPerMinute` quotas (`quota.py`) and a fallback rule: `allowed`, `never` (its prompts
never leave the premises, whatever the pool's state), or a daily token budget
(`fallback: {tokensPerDay: N}`).

    tenants:
      - name: chat-app
        apiKeys: [sha256:<hex>]
        priority: 10
      - name: nightly-eval
        apiKeys: [sha256:<hex>]
        priority: -1
        weight: 1
        tokensPerMinute: 200000
        fallback: never
    default: chat-app          # requests without a key (absent: a key is required, 401)

A request may lower its own priority with the `x-kubellm-priority` header, never raise it
(`effective_priority`). `load` reads the file and names the field of anything wrong in it;
`Tenants.identify` maps an `Authorization` header to its tenant (pure, no I/O).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubellm.gateway.protocol import errors

from kubellm import manifests

# The header a request lowers its priority with.
PRIORITY_HEADER = "x-kubellm-priority"
# The Inference Extension's headers (both front ends honour them): the objective names an
# entry of the file's `objectives` (name -> priority), which may lower the request's
# priority as the header above does; the fairness id splits a tenant's fair share among
# its own flows (each flow its own counter; never across tenants, whatever it says).
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
TENANT_HEADERS = (PRIORITY_HEADER, OBJECTIVE_HEADER, FAIRNESS_HEADER)
_FAIRNESS_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,64}")
# The names tenants may have: they become metric label values, so keep them plain.
_NAME = re.compile(r"[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_FIELDS = frozenset(
    ("name", "apiKeys", "priority", "weight", "tokensPerMinute", "requestsPerMinute",
     "fallback")
)  # fmt: skip
MAX_TENANTS = 1000  # tenant names are metric labels: a bound on their cardinality


class TenantsError(ValueError):
    """A tenants file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class FallbackRule:
    """Whether a tenant's requests may go to the external API: `allowed`, `never`, or
    `budget` (at most `tokens_per_day` fallback tokens per UTC day)."""

    kind: str = "allowed"
    tokens_per_day: int = 0


@dataclass(frozen=True)
class Tenant:
    name: str
    priority: int = 0
    weight: float = 1.0
    key_digests: frozenset[str] = frozenset()
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    fallback: FallbackRule = field(default_factory=FallbackRule)

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


# The tenant of every request when no tenants file is given: today's behaviour.
ANONYMOUS = Tenant("")


@dataclass(frozen=True)
class Tenants:
    """The declared tenants, their keys by digest, and the tenant of keyless requests
    (None: a key is required)."""

    tenants: tuple[Tenant, ...]
    default: str | None = None
    objectives: Mapping[str, int] = field(default_factory=dict)  # name -> priority

    def __post_init__(self) -> None:
        by_digest: dict[str, Tenant] = {}
        for tenant in self.tenants:
            for digest in tenant.key_digests:
                by_digest[digest] = tenant
        object.__setattr__(self, "_by_digest", by_digest)
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tenants})

    def get(self, name: str) -> Tenant | None:
        by_name: dict[str, Tenant] = self._by_name  # type: ignore[attr-defined]
        return by_name.get(name)

    def names(self) -> list[str]:
        return [t.name for t in self.tenants]

    def identify(self, authorization: str | None) -> Tenant:
        """The tenant whose key the `Authorization: Bearer <key>` header carries; a request
        without one is the default tenant's. A key that matches no tenant, or no key when
        there is no default tenant: 401."""
        if not authorization:
            if self.default is None:
                raise errors.unauthorized()
            tenant = self.get(self.default)
            assert tenant is not None  # checked by load
            return tenant
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer":
            raise errors.unauthorized()
        by_digest: dict[str, Tenant] = self._by_digest  # type: ignore[attr-defined]
        tenant = by_digest.get(digest(key.strip()))
        if tenant is None:
            raise errors.unauthorized()
        return tenant


def digest(key: str) -> str:
    """How API keys are stored: the sha256 hex of the key."""
    return hashlib.sha256(key.encode()).hexdigest()


def effective_priority(
    tenant: Tenant,
    requested: str | None,
    objective: str | None = None,
    objectives: Mapping[str, int] | None = None,
) -> int:
    """The request's priority: its tenant's, or lower when the request asks for a lower one
    by `x-kubellm-priority` or names a lower objective (`x-gateway-inference-objective`,
    looked up in `objectives`; an unknown one changes nothing); never higher. A priority
    that is not an integer: 400."""
    priority = tenant.priority
    if objective and objectives and objective in objectives:
        priority = min(priority, objectives[objective])
    if requested is None or requested == "":
        return priority
    value = requested.strip()
    if not re.fullmatch(r"[+-]?[0-9]{1,9}", value):
        raise errors.bad_request(
            f"Header {PRIORITY_HEADER} must be an integer, not {requested[:40]!r}.",
            PRIORITY_HEADER,
        )
    return min(priority, int(value))


def flow_id(tenant: Tenant, fairness_id: str | None) -> str:
    """The flow a request's fair share is counted in: its tenant, or one of the tenant's
    own flows when it carries a plain fairness id (anything else is ignored)."""
    if fairness_id and _FAIRNESS_ID.fullmatch(fairness_id):
        return f"{tenant.name}/{fairness_id}"
    return tenant.name


# ---------------------------------------------------------------------- the file


def load(path: str) -> Tenants:
    """Read a tenants file (see the module) with the manifests' strict loader (a duplicated
    key, an alias bomb, deep nesting or a second document is refused by line, as a
    manifest is); errors name the file, the line or the field."""
    try:
        documents = manifests.read_documents(path)
    except manifests.ManifestError as error:
        raise TenantsError(str(error).replace("not valid YAML", "not YAML")) from None
    if len(documents) != 1:
        raise TenantsError(f"{path}: expected one YAML document, found {len(documents)}")
    return parse(documents[0], path)


def parse(data: Any, source: str = "tenants") -> Tenants:
    """Tenants from the parsed document (see the module)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("tenants"), list):
        raise TenantsError(f"{source}: expected a mapping with a `tenants` list")
    unknown = sorted(set(data) - {"tenants", "default", "objectives"})
    if unknown:
        raise TenantsError(f"{source}: unknown field `{unknown[0]}`")
    items = data["tenants"]
    if not items:
        raise TenantsError(f"{source}: tenants: declare at least one tenant")
    if len(items) > MAX_TENANTS:
        raise TenantsError(f"{source}: tenants: at most {MAX_TENANTS} tenants")
    tenants = [_tenant(item, f"{source}: tenants[{i}]") for i, item in enumerate(items)]
    seen: dict[str, str] = {}
    owners: dict[str, str] = {}
    for tenant in tenants:
        if tenant.name in seen:
            raise TenantsError(f"{source}: tenants: `{tenant.name}` is declared twice")
        seen[tenant.name] = tenant.name
        for key in tenant.key_digests:
            if key in owners:
                raise TenantsError(
                    f"{source}: tenants `{owners[key]}` and `{tenant.name}` share an API key"
                )
            owners[key] = tenant.name
    default = data.get("default")
    if default is not None and (not isinstance(default, str) or default not in seen):
        raise TenantsError(f"{source}: default: `{default}` is not a declared tenant")
    objectives = data.get("objectives") or {}
    if not isinstance(objectives, Mapping):
        raise TenantsError(f"{source}: objectives: a mapping of objective name -> priority")
    for name, priority in objectives.items():
        if not isinstance(name, str) or type(priority) is not int:
            raise TenantsError(f"{source}: objectives.{name}: an integer priority")
    return Tenants(tuple(tenants), default, dict(objectives))


def _tenant(item: Any, where: str) -> Tenant:
    if not isinstance(item, Mapping):
        raise TenantsError(f"{where}: expected a mapping")
    unknown = sorted(set(item) - _FIELDS)
    if unknown:
        raise TenantsError(f"{where}.{unknown[0]}: unknown field")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TenantsError(
            f"{where}.name: required, lower-case letters, digits, `.`, `_` or `-` "
            "(at most 63), starting and ending with a letter or digit"
        )
    where = f"{where} ({name})"
    priority = item.get("priority", 0)
    if type(priority) is not int or not -1000 <= priority <= 1000:
        raise TenantsError(f"{where}.priority: an integer from -1000 to 1000")
    weight = item.get("weight", 1)
    if type(weight) not in (int, float) or not 0 < weight <= 1000:
        raise TenantsError(f"{where}.weight: a number above 0, at most 1000")
    return Tenant(
        name=name,
        priority=priority,
        weight=float(weight),
        key_digests=frozenset(_digests(item.get("apiKeys", []), f"{where}.apiKeys")),
        tokens_per_minute=_positive(item.get("tokensPerMinute"), f"{where}.tokensPerMinute"),
        requests_per_minute=_positive(item.get("requestsPerMinute"), f"{where}.requestsPerMinute"),
        fallback=_fallback(item.get("fallback", "allowed"), f"{where}.fallback"),
    )


def _digests(values: Any, where: str) -> Iterable[str]:
    if not isinstance(values, list):
        raise TenantsError(f"{where}: a list of `sha256:<hex>` digests")
    out = []
    for i, value in enumerate(values):
        text = value.strip().lower() if isinstance(value, str) else ""
        hexed = text.removeprefix("sha256:")
        if not _DIGEST.fullmatch(hexed):
            raise TenantsError(
                f"{where}[{i}]: not a sha256 digest (`sha256:` and 64 hex digits; store the "
                "key's digest, never the key)"
            )
        out.append(hexed)
    return out


def _positive(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value <= 0:
        raise TenantsError(f"{where}: a whole number above 0")
    return value


def _fallback(value: Any, where: str) -> FallbackRule:
    if value in ("allowed", "never"):
        return FallbackRule(value)
    if isinstance(value, Mapping) and set(value) == {"tokensPerDay"}:
        tokens = _positive(value["tokensPerDay"], f"{where}.tokensPerDay")
        assert tokens is not None
        return FallbackRule("budget", tokens)
    raise TenantsError(f"{where}: `allowed`, `never` or `{{tokensPerDay: N}}`")
