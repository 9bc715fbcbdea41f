"""Progress output that fits where it goes: one API for every long step.

On a terminal it draws a rich progress bar. Anywhere else (a CI log, `edgerun pull
--all > log 2>&1`) a redrawn bar would leave thousands of `\\r` fragments, so it
prints whole lines instead: one at the start, one per 10% of the total (or one
every few seconds when the total is unknown), and one at the end.

    with progress_bar("assembling model.gguf", total=size, unit="B") as advance:
        advance(len(chunk))                   # n more done
        advance.update(done, description=...)  # or absolute, and a new description
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["Advance", "is_terminal", "progress_bar"]

LINE_STEPS = 10  # a known total prints a line per 1/LINE_STEPS of it
LINE_INTERVAL_S = 5.0  # an unknown total prints a line at most this often


def _amount(done: int, total: int | None, unit: str) -> str:
    if unit == "B":
        text = f"{done / 1e6:.0f}" + (f"/{total / 1e6:.0f}" if total else "") + " MB"
    else:
        text = f"{done}" + (f"/{total}" if total else "") + (f" {unit}" if unit else "")
    if total:
        text += f" ({100 * done // total}%)"
    return text


class Advance:
    """What progress_bar yields: call it with the work just done, or update() absolutely."""

    def __init__(self, description: str, total: int | None) -> None:
        self.description = description
        self.total = total if total and total > 0 else None
        self.completed = 0

    def __call__(self, n: int = 1, description: str | None = None) -> None:
        self.update(self.completed + n, description=description)

    def update(
        self, completed: int, total: int | None = None, description: str | None = None
    ) -> None:
        """Set the amount done (and, when they change, the total and the description)."""
        self.completed = completed
        if total is not None:
            self.total = total if total > 0 else None
        if description is not None:
            self.description = description
        self._show()

    def _show(self) -> None:
        pass

    def _close(self, ok: bool) -> None:
        pass


class _Lines(Advance):
    """Whole lines for logs and pipes: never a carriage return."""

    def __init__(self, description: str, total: int | None, unit: str, stream: TextIO) -> None:
        super().__init__(description, total)
        self.unit, self.stream = unit, stream
        self.t0 = self.last_t = time.monotonic()
        self.last_step = 0
        self._print(_amount(0, self.total, unit))

    def _print(self, text: str) -> None:
        print(f"{self.description}: {text}", file=self.stream, flush=True)

    def _show(self) -> None:
        now = time.monotonic()
        if self.total:
            step = min(LINE_STEPS, self.completed * LINE_STEPS // self.total)
            due = step > self.last_step and self.completed < self.total
        else:
            step, due = self.last_step, now - self.last_t >= LINE_INTERVAL_S
        if due:
            self.last_step, self.last_t = step, now
            self._print(_amount(self.completed, self.total, self.unit))

    def _close(self, ok: bool) -> None:
        what = _amount(self.completed, self.total, self.unit)
        secs = time.monotonic() - self.t0
        self._print(f"{what}, done in {secs:.1f} s" if ok else f"{what}, stopped")


class _Bar(Advance):
    """A rich progress bar, for a terminal."""

    def __init__(self, description: str, total: int | None, unit: str, stream: TextIO) -> None:
        super().__init__(description, total)
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        amount: Any = DownloadColumn() if unit == "B" else MofNCompleteColumn()
        columns: list[Any] = [TextColumn("{task.description}"), BarColumn(), amount]
        if unit and unit != "B":
            columns.append(TextColumn(unit))
        columns += [TimeElapsedColumn(), TimeRemainingColumn()]
        self.bar = Progress(*columns, console=Console(file=stream))
        self.bar.start()
        self.task = self.bar.add_task(description, total=self.total)

    def _show(self) -> None:
        self.bar.update(
            self.task, completed=self.completed, total=self.total, description=self.description
        )

    def _close(self, ok: bool) -> None:
        self.bar.stop()


@contextmanager
def progress_bar(
    description: str,
    total: int | None = None,
    unit: str = "",
    stream: TextIO | None = None,
    enabled: bool = True,
) -> Iterator[Advance]:
    """Show the progress of one step on `stream` (default: stderr); see the module doc.

    unit "B" shows byte counts as MB. enabled=False shows nothing (a quiet caller).
    """
    stream = sys.stderr if stream is None else stream
    if not enabled:
        reporter = Advance(description, total)
    elif is_terminal(stream):
        reporter = _Bar(description, total, unit, stream)
    else:
        reporter = _Lines(description, total, unit, stream)
    ok = False
    try:
        yield reporter
        ok = True
    finally:
        reporter._close(ok)


def is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
