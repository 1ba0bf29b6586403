"""`kubellm up --engine sim` gives replicas different profiles and slowdowns."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kubellm.fleet.processes import Supervisor
from kubellm.fleet.runtime import LocalRuntime
from kubellm.fleet.up import configure
from tests.fixtures.engines import wait_until
from tests.fixtures.fleets import write_manifest


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(["-f", "x.yaml", *argv])


def test_profiles_and_slowdowns_are_comma_lists_checked_at_parse() -> None:
    args = _parse("--sim-profile", "llama-3.1-8b-h100,llama-3.1-8b-a100",
                  "--sim-slowdown", "1,1.5")  # fmt: skip
    assert args.sim_profile == ("llama-3.1-8b-h100", "llama-3.1-8b-a100")
    assert args.sim_slowdown == (1.0, 1.5)
    for bad in (("--sim-profile", "h100,nope"), ("--sim-slowdown", "1,x"),
                ("--sim-slowdown", "1,0")):  # fmt: skip
        with pytest.raises(SystemExit):
            _parse(*bad)


@pytest.mark.parametrize(
    ("profiles", "slowdowns", "expected"),
    [
        (None, None, [[], [], []]),
        (("a",), None, [["--profile", "a"]] * 3),
        (("a", "b"), (1.0, 1.5), [["--profile", "a"], ["--profile", "b", "--slowdown", "1.5"],
                                  ["--profile", "a"]]),
        (None, (1.0, 1.0, 2.0), [[], [], ["--slowdown", "2"]]),
    ],
)  # fmt: skip
def test_replica_i_gets_item_i_mod_n(
    tmp_path: Path, profiles: Any, slowdowns: Any, expected: list[list[str]]
) -> None:
    runtime = LocalRuntime(Supervisor(tmp_path), tmp_path, engine="sim",
                           sim_profile=profiles, sim_slowdown=slowdowns)  # fmt: skip
    assert [runtime.sim_hardware(i) for i in range(3)] == expected


def test_a_sim_fleet_runs_each_replica_on_its_own_hardware(
    start_fleet: Any, tmp_path: Path
) -> None:
    spec = {"model": {"source": "hf://org/mixed", "servedName": "mixed"}, "replicas": 2}
    fleet = start_fleet(
        write_manifest(tmp_path / "mixed.yaml", "mixed", spec),
        extra=("--sim-profile", "llama-3.1-8b-h100,llama-3.1-8b-a100", "--sim-slowdown", "1,1.5"),
    )
    logs = [fleet.run_dir / "logs" / f"mixed-{i}.log" for i in range(2)]

    def banners() -> bool:
        return all(p.exists() and "profile " in p.read_text() for p in logs)

    wait_until(lambda: banners() or fleet.process.poll() is not None, 60, "both banners")
    assert banners(), fleet.output()
    assert "profile llama-3.1-8b-h100," in logs[0].read_text()
    assert "profile llama-3.1-8b-a100x1.5," in logs[1].read_text()
    fleet.stop()
