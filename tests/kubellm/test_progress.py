"""The ticking progress line: what, elapsed time, and a last line; plain when not a terminal."""

from __future__ import annotations

import io

import pytest

from kubellm.progress import Ticker, elapsed
from tests.fixtures.engines import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_elapsed_is_short() -> None:
    assert elapsed(4.24) == "4.2s"
    assert elapsed(67.9) == "1m07s"


def test_plain_lines_when_not_a_terminal() -> None:
    out, clock = io.StringIO(), Clock()
    with Ticker("building", stream=out, tty=False, plain_every=0.01, clock=clock) as tick:
        clock.now += 3.0
        tick.note("step 2 of 3")
        wait_until(lambda: "step 2 of 3 ... 3.0s" in out.getvalue(), timeout=10, what="a tick")
        clock.now += 2.0
    lines = out.getvalue().splitlines()
    assert lines[0] == "building ... 0.0s"
    assert lines[-1] == "building: done in 5.0s"
    assert "\r" not in out.getvalue()


def test_a_terminal_line_is_redrawn_in_place_and_ends_with_a_newline() -> None:
    out, clock = io.StringIO(), Clock()
    with Ticker("starting", stream=out, tty=True, clock=clock) as tick:
        clock.now += 1.5
        tick.note("loading")  # shown at once on a terminal
    text = out.getvalue()
    assert text.startswith("\rstarting ... 0.0s")
    assert "\rstarting: loading ... 1.5s" in text
    assert text.endswith("starting: done in 1.5s\n")


def test_a_failing_block_says_failed() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), Ticker("x", stream=out, tty=False, clock=Clock()):
        raise RuntimeError("boom")
    assert out.getvalue().splitlines()[-1] == "x: failed in 0.0s"
