"""Read `LLMDeployment` manifests (the files `kubectl apply` takes) into models.

Every command that reads a manifest file (`validate`, `up`, `render`, ...)
goes through `load`, whose YAML loader refuses what the API server refuses
and what would otherwise cost a traceback or unbounded time and memory:
duplicate keys (strict field validation), excessive aliasing (an "alias bomb"
expands a few hundred bytes into millions of nodes), nesting deeper than any
manifest needs, files that are not UTF-8 text, and files with no document.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kubellm.api import LLMDeployment

# The API server refuses request bodies over 3 MiB; a manifest never comes close.
MAX_FILE_BYTES = 3 * 1024 * 1024
# Nesting deeper than this is refused (affinity, the deepest part of a spec, needs about 10).
MAX_DEPTH = 100
# Values one document may expand to once aliases are followed: a real manifest has a few
# hundred; an alias bomb has millions. Counted over distinct nodes, so refusing costs
# O(file size); at this bound, validating the largest accepted document takes ~0.1 s.
MAX_EXPANDED_NODES = 10_000


class ManifestError(ValueError):
    """A manifest that is not a valid LLMDeployment; the message names the field."""


def _line(node: yaml.Node) -> str:
    return f"line {node.start_mark.line + 1}"


class StrictLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses duplicate keys, deep nesting and excessive aliasing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def fetch_flow_collection_start(self, token_class: Any) -> None:
        # The scanner looks ahead through open flow collections (each `[` or `{` may start
        # a key), in time quadratic in their depth: stop it before the composer would.
        if self.flow_level >= MAX_DEPTH:
            raise yaml.YAMLError(f"line {self.line + 1}: nested more than {MAX_DEPTH} levels deep")
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(
                    f"line {mark.line + 1}: nested more than {MAX_DEPTH} levels deep"
                )
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node:
        node: yaml.Node = super().compose_document()
        _check_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: let the base class say so
                break
            if first is not key_node:
                raise yaml.YAMLError(
                    f"{_line(key_node)}: duplicate key {key!r} (first at {_line(first)})"
                )
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-any-return]


def _check_expansion(root: yaml.Node | None) -> None:
    """Refuse a document whose alias-expanded tree exceeds MAX_EXPANDED_NODES, or loops."""
    if root is None:
        return
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_nodes: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            if isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            else:
                children = list(node.value)
            total = 1 + sum(sizes[id(c)] for c in children)
            sizes[key] = min(total, MAX_EXPANDED_NODES + 1)
            if total > MAX_EXPANDED_NODES:
                raise yaml.YAMLError(
                    f"{_line(node)}: excessive aliasing: this value expands to more than "
                    f"{MAX_EXPANDED_NODES:,} values (a manifest needs a few hundred)"
                )
            continue
        if key in sizes:
            continue
        if isinstance(node, yaml.ScalarNode):
            sizes[key] = 1
            continue
        if key in open_nodes:
            raise yaml.YAMLError(f"{_line(node)}: an alias refers to a value that contains it")
        open_nodes.add(key)
        stack.append((node, True))
        children = (
            [n for pair in node.value for n in pair]
            if isinstance(node, yaml.MappingNode)
            else node.value
        )
        for child in children:
            if id(child) in open_nodes:
                raise yaml.YAMLError(f"{_line(child)}: an alias refers to a value that contains it")
            if id(child) not in sizes:
                stack.append((child, False))


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
    except (RecursionError, OverflowError, MemoryError) as error:  # belt and braces
        raise ManifestError(f"{source}: cannot be checked: {type(error).__name__}") from None


def read_documents(path: str | Path) -> list[Any]:
    """The YAML documents of a file, read with StrictLoader; empty documents are skipped.

    Raises ManifestError, naming the file and the line, for anything that is not a
    readable, bounded YAML text.
    """
    path = Path(path)
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise ManifestError(f"{path}: cannot read: {error.strerror or error}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ManifestError(
            f"{path}: larger than {MAX_FILE_BYTES // 2**20} MiB, the API server's request limit"
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ManifestError(
            f"{path}: not a YAML text file (byte 0x{raw[error.start]:02x} at offset "
            f"{error.start} is not UTF-8)"
        ) from None
    try:
        loader = StrictLoader(text)
        try:
            documents = []
            while loader.check_data():
                documents.append(loader.get_data())
        finally:
            loader.dispose()
    except yaml.YAMLError as error:
        raise ManifestError(f"{path}: not valid YAML: {_one_line(error, text)}") from None
    except RecursionError:
        raise ManifestError(f"{path}: nested too deeply") from None
    return [d for d in documents if d is not None]


def _one_line(error: yaml.YAMLError, text: str) -> str:
    if isinstance(error, yaml.reader.ReaderError):
        line = text.count("\n", 0, error.position) + 1
        return f"line {line}: character #x{error.character:04x} is not allowed in YAML"
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {error.problem or error.context}"
    return str(error)


def load(path: str | Path) -> Iterator[LLMDeployment]:
    """Every LLMDeployment in a YAML file (multi-document files allowed; at least one)."""
    documents = read_documents(path)
    if not documents:
        raise ManifestError(f"{path}: no LLMDeployment in this file (it has no YAML document)")
    for index, document in enumerate(documents):
        yield parse(document, f"{path}" if index == 0 else f"{path}[{index}]")
