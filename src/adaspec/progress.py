"""Progress of long commands, in a terminal and in a log file alike.

On a terminal a rich bar redraws in place; when stderr is a pipe or a file (CI, ``2> log``,
``| tee``) rich draws nothing until the end, so plain lines are printed instead: one when a
stage starts, one when it ends, and one at most every ``interval`` seconds in between, each
with the elapsed time, the count and an estimate of the time left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class StageProgress:
    """``progress(stage, done, total, detail="")``: one bar (or plain line) per named stage.

    Use as a context manager; ``step(stage, detail)`` advances a stage by one, for loops
    that count items rather than report a position. ``remove_finished`` drops a finished
    stage's bar from the terminal display (long pipelines with many stages).
    """

    def __init__(self, console: Console, *, interval: float = 5.0, remove_finished: bool = False,
                 live: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.live = console.is_terminal if live is None else live
        self.interval = interval
        self.remove_finished = remove_finished
        self._clock = clock
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}
        self._state: dict[str, list[float]] = {}  # stage -> [done, total, started, last printed]
        self._t0 = clock()

    def __enter__(self) -> StageProgress:
        self._t0 = self._clock()
        if self.live:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=True)
            self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None

    def __call__(self, stage: str, done: int, total: int, detail: str = "") -> None:
        now = self._clock()
        state = self._state.get(stage)
        new = state is None
        if new:
            state = self._state[stage] = [done, total, now, -1.0]
        state[0], state[1] = done, total
        finished = total > 0 and done >= total
        if self._bar is not None:
            text = escape(f"{stage} {detail}".strip()[:70])
            if stage not in self._tasks:
                self._tasks[stage] = self._bar.add_task(text, total=total)
            self._bar.update(self._tasks[stage], completed=done, total=total, description=text)
            if finished and self.remove_finished:
                self._bar.remove_task(self._tasks.pop(stage))
            return
        if new or finished or now - state[3] >= self.interval:
            state[3] = now
            self._line(stage, done, total, detail, now - state[2])

    def step(self, stage: str, detail: str = "", total: int | None = None) -> None:
        """Advance ``stage`` by one item (``total`` once, or on the first call)."""
        state = self._state.get(stage)
        done = int(state[0]) + 1 if state else 1
        self(stage, done, total if total is not None else int(state[1]) if state else 0, detail)

    def message(self, text: str) -> None:
        """A line above the bar (terminal) or in the log."""
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def _line(self, stage: str, done: int, total: int, detail: str, spent: float) -> None:
        count = f"{done}/{total}" + (f" ({done / total:.0%})" if total else "")
        left = f", ~{_clock(spent / done * (total - done))} left" if 0 < done < total and spent > 1 else ""
        text = f"[{_clock(self._clock() - self._t0)}] {stage}: {count}{left}"
        if detail:
            text += f"  {detail}"
        self.message(text)
