"""The run clock's marks: a milestone keeps its first time, and a new command starts afresh
(the CLI runs several commands in one process in tests and in `fabric demo`)."""

from __future__ import annotations

import time

from fabric_pipelines.cli import run_clock


def test_a_mark_keeps_its_first_time_and_a_new_command_forgets_the_last() -> None:
    run_clock.begin("cli_started")
    run_clock.mark("submitted")
    first = run_clock.marks()["submitted"]
    time.sleep(0.01)
    run_clock.mark("submitted")
    assert run_clock.marks()["submitted"] == first
    run_clock.begin("cli_started")
    assert set(run_clock.marks()) == {"cli_started"}
