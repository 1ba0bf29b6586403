"""The request path's histogram exposes what prometheus-client's `Histogram` does."""

from __future__ import annotations

import math

import pytest
from kubellm.gateway.routing.latency.histogram import Histogram
from prometheus_client import CollectorRegistry
from prometheus_client import Histogram as Reference
from prometheus_client.exposition import generate_latest

BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.05, 0.1, 0.5, 1)
# on a bound, between bounds, under the first, over the last, zero, negative
VALUES = [0.001, 0.0049, 0.005, 0.0051, 0.03, 0.5, 0.75, 1.0, 1.5, 40.0, 0.0, -0.2]


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def _text(registry: CollectorRegistry) -> list[str]:
    return [ln for ln in generate_latest(registry).decode().splitlines() if "_created" not in ln]


def _pair() -> tuple[CollectorRegistry, Reference, CollectorRegistry, Histogram]:
    ref_registry, registry = CollectorRegistry(), CollectorRegistry()
    ref = Reference("x_seconds", "help", ["model", "kind"], buckets=BUCKETS, registry=ref_registry)
    ours = Histogram("x_seconds", "help", ["model", "kind"], buckets=BUCKETS, registry=registry)
    return ref_registry, ref, registry, ours


def test_one_at_a_time_and_all_at_once_expose_what_the_reference_does() -> None:
    ref_registry, ref, registry, ours = _pair()
    for value in VALUES:
        ref.labels("m", "a").observe(value)
        ours.labels("m", "a").observe(value)
    for value in VALUES[:5]:
        ref.labels("m", "b").observe(value)
    ours.labels("m", "b").observe_all(VALUES[:5])
    ours.labels("m", "b").observe_all([])  # nothing to count
    ref.labels("n", "c")  # a label set that exists at zero
    ours.labels("n", "c")

    expected = _samples(ref_registry)
    found = _samples(registry)
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        assert math.isclose(found[key], value, abs_tol=1e-12), key
    # and the text format names and orders the buckets the same way
    assert _text(registry) == _text(ref_registry)


def test_the_wrong_number_of_labels_is_refused() -> None:
    ours = Histogram("y_seconds", "help", ["model"], buckets=BUCKETS, registry=CollectorRegistry())
    with pytest.raises(ValueError, match="labels"):
        ours.labels("a", "b")


def test_a_name_registered_twice_is_refused_as_the_reference_refuses_it() -> None:
    registry = CollectorRegistry()
    Histogram("z_seconds", "help", ["model"], buckets=BUCKETS, registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Histogram("z_seconds", "help", ["model"], buckets=BUCKETS, registry=registry)
