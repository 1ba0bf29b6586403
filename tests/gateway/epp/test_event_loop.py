"""`kubellm epp` runs on uvloop's event loop when it is installed (as uvicorn runs the
gateway; ~24% fewer picker instructions per exchange, bench/gateway/proxy.py
--instructions --instructions-paths envoy+epp), asyncio's when told."""

from __future__ import annotations

import pytest
from kubellm.gateway.epp import cli


def test_the_picker_runs_on_uvloop_unless_told_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.delenv("KUBELLM_EPP_LOOP", raising=False)
    assert cli.event_loop_factory() is uvloop.new_event_loop
    monkeypatch.setenv("KUBELLM_EPP_LOOP", "asyncio")
    assert cli.event_loop_factory() is None  # asyncio.Runner's default loop
