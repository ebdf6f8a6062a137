"""Progress bars for people watching a terminal.

`RunProgress` is one bar for a whole `fabric submit --run` / `fabric run`: the stage it is in
(ingest, plan, extract, index), tasks done, real tokens/s and the time left. The CLI opens it
(`run_progress`) around its in-process run; the assets report their stage to it with `stage`.
Without one, an extraction step shows `TaskProgress`, a bar over the set's finished tasks.
Both show only when stderr is a terminal; in the Dagster UI the same progress arrives as log
lines and asset observations instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

from fabric_pipelines.lib.broker.ledger import Accounting


class RunProgress:
    """Stage, tasks done (finished: completed or failed), real tokens/s, ETA."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.bar: tqdm | None = None
        self.stage_name = "start"
        self._tokens_per_task = 0.0
        self._extract_started = 0.0
        self._done_at_start = 0

    def _ensure_bar(self) -> tqdm | None:
        if self.enabled and self.bar is None:
            self.bar = tqdm(total=0, desc=self.stage_name, unit="task", dynamic_ncols=True)
        return self.bar

    def stage(self, name: str, *, tasks: int = 0, real_tokens: int = 0) -> None:
        """Enter a stage; extraction passes the plan's tasks and real tokens (for tokens/s)."""
        self.stage_name = name
        if tasks:
            self._tokens_per_task = real_tokens / tasks
        self._extract_started = time.monotonic()
        bar = self._ensure_bar()
        if bar is not None:
            self._done_at_start = int(bar.n)
            if tasks:
                bar.total = tasks
            bar.set_description(name, refresh=True)

    def tasks(self, counts: Accounting) -> None:
        bar = self._ensure_bar()
        if bar is None:
            return
        bar.total = counts.tasks
        bar.n = counts.completed + counts.reused + counts.failed
        elapsed = max(time.monotonic() - self._extract_started, 1e-9)
        rate = (bar.n - self._done_at_start) * self._tokens_per_task / elapsed
        bar.set_postfix_str(
            f"{rate / 1e6:.2f} M tok/s, failed {counts.failed:,}, in flight {counts.in_flight:,}",
            refresh=False,
        )
        bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


_active: RunProgress | None = None


@contextmanager
def run_progress(enabled: bool | None = None) -> Iterator[RunProgress]:
    """The process's run-wide bar for the duration of the block."""
    global _active
    previous, _active = _active, RunProgress(enabled)
    try:
        yield _active
    finally:
        _active.close()
        _active = previous


def current_run_progress() -> RunProgress | None:
    return _active


def stage(name: str, *, tasks: int = 0, real_tokens: int = 0) -> None:
    """Tell the run-wide bar, if one is open, which stage the run is in."""
    if _active is not None:
        _active.stage(name, tasks=tasks, real_tokens=real_tokens)


class TaskProgress:
    """An extraction step's bar; forwards to the run-wide bar when one is open."""

    def __init__(self, desc: str, enabled: bool | None = None) -> None:
        self.desc = desc
        self.run = current_run_progress()
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.bar: tqdm | None = None

    def update(self, counts: Accounting) -> None:
        if self.run is not None:
            self.run.tasks(counts)
            return
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = tqdm(total=counts.tasks, desc=self.desc, unit="task", dynamic_ncols=True)
        self.bar.n = counts.completed + counts.reused + counts.failed
        self.bar.set_postfix(
            reused=counts.reused, failed=counts.failed, in_flight=counts.in_flight, refresh=False
        )
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
