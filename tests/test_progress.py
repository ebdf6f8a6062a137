"""The terminal progress bar over a task set's finished tasks."""

from __future__ import annotations

import pytest

from fabric_pipelines.lib.broker.ledger import Accounting
from fabric_pipelines.lib.steps.progress import (
    TaskProgress,
    current_run_progress,
    run_progress,
    stage,
)


def test_the_bar_counts_completed_and_failed_tasks(capsys: pytest.CaptureFixture[str]) -> None:
    bar = TaskProgress("extract s", enabled=True)
    bar.update(Accounting(tasks=10, completed=3, failed=1, in_flight=2, queued=4))
    bar.update(Accounting(tasks=10, completed=8, failed=2, in_flight=0, queued=0))
    bar.close()
    err = capsys.readouterr().err
    assert "extract s" in err and "4/10" in err and "10/10" in err and "failed=2" in err


def test_no_bar_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    bar = TaskProgress("extract s", enabled=False)
    bar.update(Accounting(tasks=10, completed=3, failed=1, in_flight=2, queued=4))
    bar.close()
    assert capsys.readouterr().err == ""


def test_the_run_bar_follows_the_stages_and_takes_over_the_extraction_bar(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with run_progress(enabled=True) as run:
        stage("ingest")
        stage("extract", tasks=10, real_tokens=1000)
        bar = TaskProgress("extract s", enabled=True)  # forwards to the run's bar
        bar.update(Accounting(tasks=10, completed=3, failed=1, in_flight=2, queued=4))
        bar.close()
        assert run.stage_name == "extract" and run.bar is not None and run.bar.n == 4
        stage("index")
    err = capsys.readouterr().err
    assert "ingest" in err and "extract" in err and "index" in err
    assert "M tok/s" in err and "failed 1" in err
    assert current_run_progress() is None  # closed with its block


def test_stages_without_a_run_bar_are_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    stage("ingest")
    assert current_run_progress() is None and capsys.readouterr().err == ""
