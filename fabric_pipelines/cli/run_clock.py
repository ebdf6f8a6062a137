"""Wall-clock marks of one command's run, for its report: where the seconds between launch and
exit went that no asset's own timing accounts for (imports, schema, submit, Dagster's steps).

Marks are `time.time()` so a caller that launched the process can line them up with its own
clock; `steps_of` reads each Dagster step's start and end from the instance's event log."""

from __future__ import annotations

import time
from typing import Any

_MARKS: dict[str, float] = {}


def begin(name: str, at: float | None = None) -> None:
    """A new command starts: forget the marks of any earlier one in this process, note `name`
    (at `at`, a `time.time()` value, where the command started in another process)."""
    _MARKS.clear()
    _MARKS[name] = time.time() if at is None else at


def mark(name: str) -> None:
    """Note that `name` happened now (the first time only: a mark is a milestone)."""
    _MARKS.setdefault(name, time.time())


def marks() -> dict[str, float]:
    return dict(_MARKS)


def steps_of(instance: Any, run_id: str) -> dict[str, dict[str, float]]:
    """Each step of a run: its start and end (success or failure) as `time.time()` values."""
    import dagster as dg

    wanted = {
        dg.DagsterEventType.STEP_START: "start",
        dg.DagsterEventType.STEP_SUCCESS: "end",
        dg.DagsterEventType.STEP_FAILURE: "end",
        dg.DagsterEventType.RUN_START: "start",
        dg.DagsterEventType.RUN_SUCCESS: "end",
        dg.DagsterEventType.RUN_FAILURE: "end",
    }
    steps: dict[str, dict[str, float]] = {}
    for entry in instance.all_logs(run_id):
        event = entry.dagster_event
        if event is None or event.event_type not in wanted:
            continue
        key = event.step_key or "run"
        steps.setdefault(key, {})[wanted[event.event_type]] = entry.timestamp
    return steps
