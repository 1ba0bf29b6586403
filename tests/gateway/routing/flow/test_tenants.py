"""Tenants: the file's fields (errors name them), key lookup by digest, the default tenant,
and a priority header that may lower a request's priority, never raise it."""

from __future__ import annotations

import pytest
from kubellm.gateway.protocol.errors import GatewayError
from kubellm.gateway.routing.flow import tenants
from kubellm.gateway.routing.flow.tenants import FallbackRule, effective_priority

CHAT_KEY, EVAL_KEY = "sk-chat", "sk-eval"
DOC = {
    "tenants": [
        {"name": "chat-app", "apiKeys": [f"sha256:{tenants.digest(CHAT_KEY)}"], "priority": 10},
        {
            "name": "nightly-eval",
            "apiKeys": [f"sha256:{tenants.digest(EVAL_KEY)}"],
            "priority": -1,
            "weight": 1,
            "tokensPerMinute": 200000,
            "fallback": "never",
        },
    ]
}


def test_the_issue_example_parses():
    declared = tenants.parse(DOC)
    chat, evals = declared.tenants
    assert (chat.name, chat.priority, chat.weight, chat.sheddable) == ("chat-app", 10, 1.0, False)
    assert (evals.priority, evals.tokens_per_minute, evals.sheddable) == (-1, 200000, True)
    assert evals.fallback == FallbackRule("never")
    assert chat.fallback == FallbackRule("allowed")
    assert declared.default is None


def test_keys_map_to_their_tenant_by_digest():
    declared = tenants.parse(DOC)
    assert declared.identify(f"Bearer {CHAT_KEY}").name == "chat-app"
    assert declared.identify(f"bearer  {EVAL_KEY} ").name == "nightly-eval"
    for bad in ("Bearer sk-other", f"Basic {CHAT_KEY}", "Bearer "):
        with pytest.raises(GatewayError) as error:
            declared.identify(bad)
        assert error.value.status == 401


def test_a_keyless_request_is_the_default_tenants_or_401():
    with pytest.raises(GatewayError) as error:
        tenants.parse(DOC).identify(None)
    assert error.value.status == 401
    with_default = tenants.parse({**DOC, "default": "nightly-eval"})
    assert with_default.identify(None).name == "nightly-eval"
    assert with_default.identify("").name == "nightly-eval"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, 10),
        ("", 10),
        ("3", 3),  # lower: taken
        ("-5", -5),
        ("10", 10),
        ("11", 10),  # higher: never
        ("1000", 10),
    ],
)
def test_a_request_may_lower_its_priority_never_raise_it(header, expected):
    chat = tenants.parse(DOC).tenants[0]
    assert effective_priority(chat, header) == expected


@pytest.mark.parametrize("header", ["high", "1.5", "1e3", "9999999999"])
def test_a_priority_header_that_is_no_integer_is_a_400_naming_it(header):
    chat = tenants.parse(DOC).tenants[0]
    with pytest.raises(GatewayError) as error:
        effective_priority(chat, header)
    assert error.value.status == 400
    assert "x-kubellm-priority" in error.value.message


def test_fallback_budget_per_day():
    doc = {"tenants": [{"name": "a", "fallback": {"tokensPerDay": 5000}}]}
    assert tenants.parse(doc).tenants[0].fallback == FallbackRule("budget", 5000)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"name": "Chat App"}, "tenants[0].name"),
        ({"name": None}, "tenants[0].name"),
        ({"priority": "high"}, "(chat-app).priority"),
        ({"priority": 1.5}, "(chat-app).priority"),
        ({"weight": 0}, "(chat-app).weight"),
        ({"weight": True}, "(chat-app).weight"),
        ({"tokensPerMinute": -1}, "(chat-app).tokensPerMinute"),
        ({"requestsPerMinute": 0}, "(chat-app).requestsPerMinute"),
        ({"fallback": "sometimes"}, "(chat-app).fallback"),
        ({"fallback": {"tokensPerDay": 0}}, "(chat-app).fallback.tokensPerDay"),
        ({"apiKeys": ["sk-plain-key"]}, "(chat-app).apiKeys[0]"),
        ({"apiKeys": "sha256:ab"}, "(chat-app).apiKeys"),
        ({"colour": "red"}, "tenants[0].colour"),
    ],
)
def test_bad_fields_are_named(change, named):
    first = {**DOC["tenants"][0], **change}
    with pytest.raises(tenants.TenantsError) as error:
        tenants.parse({"tenants": [first, DOC["tenants"][1]]}, "t.yaml")
    assert named in str(error.value)
    assert str(error.value).startswith("t.yaml: ")


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({}, "`tenants` list"),
        ({"tenants": []}, "at least one"),
        ({"tenants": [{"name": "a"}, {"name": "a"}]}, "declared twice"),
        ({**DOC, "default": "nobody"}, "default"),
        ({**DOC, "extra": 1}, "unknown field `extra`"),
        (
            {"tenants": [{"name": "a", "apiKeys": [f"sha256:{'a' * 64}"]},
                         {"name": "b", "apiKeys": [f"sha256:{'a' * 64}"]}]},
            "share an API key",
        ),
    ],
)  # fmt: skip
def test_bad_documents_are_refused(doc, words):
    with pytest.raises(tenants.TenantsError) as error:
        tenants.parse(doc)
    assert words in str(error.value)


def test_load_reads_a_file_and_names_it(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - name: a\n    priority: 1\n")
    assert tenants.load(str(path)).tenants[0].priority == 1
    path.write_text("tenants: [\n")
    with pytest.raises(tenants.TenantsError, match="not YAML"):
        tenants.load(str(path))
    with pytest.raises(tenants.TenantsError, match=r"missing\.yaml"):
        tenants.load(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize(
    ("text", "words"),
    [
        # a bad merge: `tenants:` twice; a plain YAML load keeps the second list only
        ("tenants:\n  - name: a\ntenants:\n  - name: b\n", "line 3: duplicate key 'tenants'"),
        ("tenants:\n  - name: a\n    priority: 1\n    priority: 2\n", "line 4: duplicate key"),
        (
            "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 5))
            + "tenants: [*l4]\n",
            "aliasing",
        ),
        ("tenants:\n  - name: a\n---\ntenants:\n  - name: b\n", "one YAML document"),
        ("", "one YAML document"),
    ],
)
def test_the_file_is_read_strictly_and_refused_by_line(tmp_path, text, words):
    """Issue 39 item 12: the tenants file goes through the manifests' strict loader."""
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(tenants.TenantsError, match=r"tenants\.yaml") as error:
        tenants.load(str(path))
    assert words in str(error.value)


def test_an_objective_may_lower_the_priority_never_raise_it():
    declared = tenants.parse({**DOC, "objectives": {"batch": -3, "urgent": 100}})
    chat = declared.tenants[0]
    lower = effective_priority(chat, None, "batch", declared.objectives)
    assert lower == -3
    assert effective_priority(chat, None, "urgent", declared.objectives) == 10
    assert effective_priority(chat, None, "unknown", declared.objectives) == 10
    assert effective_priority(chat, "-5", "batch", declared.objectives) == -5
    with pytest.raises(tenants.TenantsError, match="objectives"):
        tenants.parse({**DOC, "objectives": {"batch": "low"}})


def test_a_fairness_id_splits_the_tenants_flow_only_when_plain():
    chat = tenants.parse(DOC).tenants[0]
    assert tenants.flow_id(chat, None) == "chat-app"
    assert tenants.flow_id(chat, "user-7") == "chat-app/user-7"
    assert tenants.flow_id(chat, "x" * 65) == "chat-app"
    assert tenants.flow_id(chat, "a b") == "chat-app"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--band-ttl", "0"], "--band-ttl"),
        (["--max-band-queue", "0"], "--max-band-queue"),
        (["--headroom-load", "-1"], "--headroom-load"),
        (["--headroom-kv-usage", "1.5"], "--headroom-kv-usage"),
        (["--fair-in-flight-tokens", "0"], "--fair-in-flight-tokens"),
        (["--fair-in-flight-tokens", "lots"], "--fair-in-flight-tokens"),
        (["--headroom-prefill-rate", "0"], "--headroom-prefill-rate"),
        (["--headroom-prefill-rate", "fast"], "--headroom-prefill-rate"),
    ],
)
def test_tenancy_flags_name_a_bad_value(tmp_path, argv, named):
    import argparse

    from kubellm.gateway.routing.flow import flags as tenant_flags

    path = tmp_path / "t.yaml"
    path.write_text("tenants:\n  - name: a\n")
    parser = argparse.ArgumentParser()
    tenant_flags.add_arguments(parser)
    assert tenant_flags.settings_from(parser.parse_args([])) is None  # no --tenants: off
    good = tenant_flags.settings_from(
        parser.parse_args(
            ["--tenants", str(path), "--headroom-load", "12", "--fair-in-flight-tokens", "9600"]
        )
    )
    assert good.tenants.names() == ["a"] and good.flow.headroom_load == 12
    assert good.flow.fair_in_flight_tokens == 9600
    shipped = tenant_flags.settings_from(parser.parse_args(["--tenants", str(path)]))
    assert shipped.flow.fair_in_flight and shipped.flow.fair_in_flight_tokens is None  # derived
    off = ["--tenants", str(path), "--fair-in-flight-tokens", "off"]
    assert not tenant_flags.settings_from(parser.parse_args(off)).flow.fair_in_flight
    assert shipped.flow.headroom_prefill_learnt and shipped.flow.headroom_prefill_rate is None
    off = ["--tenants", str(path), "--headroom-prefill-rate", "off"]
    assert not tenant_flags.settings_from(parser.parse_args(off)).flow.headroom_prefill_learnt
    fixed = ["--tenants", str(path), "--headroom-prefill-rate", "15000"]
    assert tenant_flags.settings_from(parser.parse_args(fixed)).flow.headroom_prefill_rate == 15000
    with pytest.raises(ValueError, match=named):
        tenant_flags.settings_from(parser.parse_args(["--tenants", str(path), *argv]))
    path.write_text("tenants:\n  - name: Bad Name\n")
    with pytest.raises(ValueError, match=r"--tenants: .*tenants\[0\]\.name"):
        tenant_flags.settings_from(parser.parse_args(["--tenants", str(path)]))
