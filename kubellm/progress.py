"""A ticking progress line on stderr for steps that take more than a couple of seconds.

On a terminal the line is redrawn in place about once a second with the elapsed
time; elsewhere (CI logs, pipes) a plain line is written when the step starts,
every `plain_every` seconds while it runs, and when it ends. Nothing is printed
to stdout, so a command's output stays machine-readable.

    with Ticker("building the tiny checkpoint") as tick:
        ...                      # blocking work; the line ticks on its own
        tick.note("step 2 of 3")  # what is happening now (optional)
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO


def elapsed(seconds: float) -> str:
    """`4.2s`, `1m07s`: short enough for a status line."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s"


class Ticker:
    """Show `what` and the elapsed time until the block ends (see the module docstring)."""

    def __init__(
        self,
        what: str,
        *,
        stream: TextIO | None = None,
        tty: bool | None = None,
        interval: float = 1.0,
        plain_every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = interval if self.tty else plain_every
        self.clock = clock
        self.detail = ""
        self.started = clock()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._width = 0

    def note(self, detail: str) -> None:
        """Say what is happening now; shown on the next tick (at once on a terminal)."""
        with self._lock:
            changed = detail != self.detail
            self.detail = detail
        if changed and self.tty:
            self._write()

    def line(self) -> str:
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.what}{detail} ... {elapsed(self.clock() - self.started)}"

    def _write(self, final: str | None = None) -> None:
        with self._lock:
            text = final if final is not None else self.line()
            if self.tty:  # blank the previous line, then write this one over it
                blank = "\r" + " " * self._width if self._width > len(text) else ""
                self._width = len(text)
                end = "\n" if final is not None else ""
                self.stream.write(f"{blank}\r{text}{end}")
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._write()

    def __enter__(self) -> Ticker:
        self.started = self.clock()
        self._write()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()
        return self

    def finish(self, result: str = "done") -> None:
        """Stop ticking and write the last line: what, the result and the total time."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        took = elapsed(self.clock() - self.started)
        self._write(f"{self.what}: {result} in {took}")

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.finish("done" if kind is None else "failed")
