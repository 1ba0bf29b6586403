"""Read `LLMDeployment` manifests (the files `kubectl apply` takes) into models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kubellm.api import LLMDeployment


class ManifestError(ValueError):
    """A manifest that is not a valid LLMDeployment; the message names the field."""


def _location(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1] if parts else ''}[{item}]"]
        elif isinstance(item, str) and not item.startswith(("function-", "literal[")):
            parts.append(item)
    return ".".join(parts)


def explain(error: ValidationError) -> str:
    """One line per problem, each naming the field as it is written in the manifest."""
    lines = []
    for problem in error.errors():
        where = _location(problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "unknown field"
        named = not where or message.startswith(where)
        lines.append(message if named else f"{where}: {message}")
    return "\n".join(dict.fromkeys(lines))


def parse(document: dict[str, Any], source: str = "<manifest>") -> LLMDeployment:
    """Validate one manifest document; raise ManifestError naming the offending field."""
    if not isinstance(document, dict):
        raise ManifestError(f"{source}: expected a mapping, got {type(document).__name__}")
    try:
        return LLMDeployment.model_validate(document)
    except ValidationError as error:
        raise ManifestError(f"{source}: invalid LLMDeployment\n{explain(error)}") from None


def load(path: str | Path) -> Iterator[LLMDeployment]:
    """Every LLMDeployment in a YAML file (multi-document files allowed)."""
    path = Path(path)
    try:
        documents = list(yaml.safe_load_all(path.read_text()))
    except (OSError, yaml.YAMLError) as error:
        raise ManifestError(f"{path}: {error}") from None
    for index, document in enumerate(d for d in documents if d is not None):
        yield parse(document, f"{path}" if index == 0 else f"{path}[{index}]")
