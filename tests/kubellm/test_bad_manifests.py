"""Bad manifests against `kubellm validate` (and `render`, `up`): each refused by name.

Every case must exit non-zero, name the field, key or problem, print no traceback,
and cost bounded memory. The pathological files (binary, 20,000 levels deep, an
alias bomb) are built here rather than committed.
"""

from __future__ import annotations

import functools
import itertools
import tracemalloc
from pathlib import Path

import pytest

from kubellm import cli, manifests

HEAD = """apiVersion: kubellm.io/v1alpha1
kind: LLMDeployment
metadata: {name: bad}
spec:
  model: {source: hf://org/model}
"""


def alias_bomb(levels: int = 10) -> str:
    """A few hundred bytes under tolerations that expand to 9**levels values."""
    names = "abcdefghijklmnop"
    lines = ["    tolerations:", "    - {key: a, value: &a [x, x, x, x, x, x, x, x, x]}"]
    for previous, name in itertools.pairwise(names[:levels]):
        refs = ", ".join([f"*{previous}"] * 9)
        lines.append(f"    - {{key: {name}, value: &{name} [{refs}]}}")
    return HEAD + "  scheduling:\n" + "\n".join(lines) + "\n"


CASES: dict[str, tuple[bytes, list[str]]] = {
    "empty file": (b"", ["no LLMDeployment"]),
    "only document markers": (b"---\n---\n", ["no LLMDeployment"]),
    "only a comment": (b"# nothing here\n", ["no LLMDeployment"]),
    "binary": (bytes(range(256)) * 8, ["not a YAML text file", "not UTF-8"]),
    "NUL byte": (HEAD.encode() + b"  replicas: 1\x00\n", ["not valid YAML", "line 6"]),
    "nested 20,000 deep": (b"a: " + b"[" * 20_000 + b"]" * 20_000 + b"\n", ["nested more than"]),
    "alias bomb under tolerations": (alias_bomb().encode(), ["excessive aliasing", "line"]),
    "recursive alias": (HEAD.encode() + b"  extraArgs: &x [*x]\n", ["alias refers to a value"]),
    "duplicate key": (
        HEAD.encode() + b"  replicas: 2\n  replicas: 3\n",
        ["duplicate key 'replicas'", "line 7", "first at line 6"],
    ),
    "duplicate nested key": (
        HEAD.encode() + b"  slo:\n    ttftSeconds: 1\n    ttftSeconds: 2\n",
        ["duplicate key 'ttftSeconds'"],
    ),
    "replicas beyond int64": (
        HEAD.encode() + b"  replicas: 9223372036854775808\n", ["spec.replicas"]
    ),
    "grace period beyond int64": (
        HEAD.encode() + b"  terminationGracePeriodSeconds: 18446744073709551616\n",
        ["spec.terminationGracePeriodSeconds", "64-bit"],
    ),
    "infinite TTFT target": (
        HEAD.encode() + b"  slo: {ttftSeconds: .inf}\n", ["spec.slo.ttftSeconds", "finite"]
    ),
    "NaN ITL target": (
        HEAD.encode() + b"  slo: {itlSeconds: .nan}\n", ["spec.slo.itlSeconds", "finite"]
    ),
    "infinite load bound": (
        HEAD.encode() + b"  routing: {loadBound: .inf}\n", ["spec.routing.loadBound"]
    ),
    "cpu and memory not quantities": (
        HEAD.encode() + b"  resources: {cpu: two, memory: 4GB}\n",
        ["spec.resources.cpu", "'two'", "spec.resources.memory", "'4GB'", "quantity"],
    ),
    "negative cpu": (HEAD.encode() + b"  resources: {cpu: '-1'}\n", ["spec.resources.cpu"]),
    "syntax error": (HEAD.encode() + b"  replicas: [1, 2\n", ["not valid YAML", "line"]),
    "tab indentation": (HEAD.encode() + b"\treplicas: 1\n", ["not valid YAML", "line 6"]),
    "a list, not a mapping": (b"- a\n- b\n", ["expected a mapping"]),
    "unhashable key": (HEAD.encode() + b"  ? [a, b]\n  : c\n", ["not valid YAML", "unhashable"]),
    "second document bad": (
        (HEAD + "---\n" + HEAD.replace("name: bad", "name: b2") + "  replicas: -1\n").encode(),
        ["[1]", "spec.replicas"],
    ),
    "wrong kind": (HEAD.replace("LLMDeployment", "Deployment").encode(), ["kind"]),
    "larger than the API server takes": (
        HEAD.encode() + b"# " + b"x" * (manifests.MAX_FILE_BYTES) + b"\n",
        ["larger than 3 MiB"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    """Build the models' validators and CEL programs once, so memory is the refusal's."""
    import yaml

    manifests.parse(yaml.safe_load(HEAD))


def _validate(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, str]:
    code = cli.main(["validate", "-f", str(path)])
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("name", list(CASES))
def test_validate_refuses_naming_the_problem(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, expected = CASES[name]
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    tracemalloc.start()
    try:
        code, output = _validate(capsys, path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 1, output
    assert "Traceback" not in output
    assert str(path) in output
    for text in expected:
        assert text in output, output
    assert peak < 64 * 2**20, f"{name}: {peak / 2**20:.0f} MiB to refuse"


def test_the_alias_bomb_is_refused_before_any_value_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refusal is counted over distinct nodes, before construction: O(file), not O(9**10)."""
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(10))
    assert path.stat().st_size < 1024
    constructed = 0
    original = manifests.StrictLoader.construct_object

    def counting(self: manifests.StrictLoader, node: object, deep: bool = False) -> object:
        nonlocal constructed
        constructed += 1
        return original(self, node, deep)  # type: ignore[arg-type]

    monkeypatch.setattr(manifests.StrictLoader, "construct_object", counting)
    tracemalloc.start()
    try:
        with pytest.raises(manifests.ManifestError, match="excessive aliasing"):
            list(manifests.load(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert constructed == 0
    assert peak < 4 * 2**20


def test_a_small_alias_within_the_bound_is_accepted(tmp_path: Path) -> None:
    """Aliases are legal YAML: only excessive expansion is refused."""
    path = tmp_path / "ok.yaml"
    path.write_text(
        HEAD + "  scheduling:\n    nodeSelector: &sel {pool: gpu}\n"
        "    affinity: {x: *sel, y: *sel}\n"
    )
    (deployment,) = manifests.load(path)
    assert deployment.spec.scheduling.affinity == {"x": {"pool": "gpu"}, "y": {"pool": "gpu"}}


def test_an_expansion_just_over_the_bound_is_refused(tmp_path: Path) -> None:
    per = 100
    levels = 1
    while per**levels <= manifests.MAX_EXPANDED_NODES:
        levels += 1
    items = ", ".join(["x"] * per)
    lines = [f"    - {{key: l0, value: &l0 [{items}]}}"]
    for level in range(1, levels):
        refs = ", ".join([f"*l{level - 1}"] * per)
        lines.append(f"    - {{key: l{level}, value: &l{level} [{refs}]}}")
    path = tmp_path / "over.yaml"
    path.write_text(HEAD + "  scheduling:\n    tolerations:\n" + "\n".join(lines) + "\n")
    with pytest.raises(manifests.ManifestError, match="excessive aliasing"):
        list(manifests.load(path))


@pytest.mark.parametrize("command", ["render", "up"])
@pytest.mark.parametrize("name", ["alias bomb under tolerations", "duplicate key", "empty file"])
def test_render_and_up_use_the_same_loader(
    command: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, expected = CASES[name]
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    code = cli.main([command, "-f", str(path)])
    out, err = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in out + err
    assert expected[0] in err


@functools.cache
def _generated_crd() -> dict:
    import yaml

    from kubellm import crd

    return yaml.safe_load(crd.render())


@pytest.mark.parametrize(
    ("quantity", "valid"),
    [
        ("2", True), ("500m", True), ("0.5", True), ("1.5Gi", True), ("64Gi", True),
        ("4G", True), ("1e3", True), ("+1", True), (".5", True), ("128974848", True),
        ("two", False), ("4GB", False), ("-1", False), ("1.5 Gi", False), ("", False),
        ("Gi", False), ("1gi", False), ("1e", False), ("0x10", False),
    ],
)  # fmt: skip
def test_quantities_are_judged_alike_by_the_models_and_the_crd(quantity: str, valid: bool) -> None:
    """The API server's grammar, in the models and as the CRD's pattern."""
    import yaml

    from tests.fixtures import crd_validation

    document = yaml.safe_load(HEAD)
    document["spec"]["resources"] = {"cpu": quantity, "memory": quantity}
    _, errors = crd_validation.validate(_generated_crd(), document)
    crd_ok = not errors
    try:
        manifests.parse(document)
        model_ok = True
    except manifests.ManifestError as error:
        model_ok = False
        assert "spec.resources.cpu" in str(error) and "spec.resources.memory" in str(error)
    assert (crd_ok, model_ok) == (valid, valid), errors


def test_deep_flow_nesting_is_refused_before_the_scanner_reads_it_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PyYAML's scanner looks ahead through open `[`s in quadratic time: it stops at the bound."""
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * 1_000_000 + "]" * 1_000_000 + "\n")  # 2 MB, under the limit
    opened = 0
    original = manifests.StrictLoader.fetch_flow_collection_start

    def counting(self: manifests.StrictLoader, token_class: object) -> None:
        nonlocal opened
        opened += 1
        original(self, token_class)

    monkeypatch.setattr(manifests.StrictLoader, "fetch_flow_collection_start", counting)
    with pytest.raises(manifests.ManifestError, match="nested more than 100 levels"):
        list(manifests.load(path))
    assert opened == manifests.MAX_DEPTH + 1
