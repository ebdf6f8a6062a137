"""The terminal progress bar over a task set's finished tasks."""

from __future__ import annotations

import pytest

from fabric_pipelines.lib.broker.ledger import Accounting
from fabric_pipelines.lib.progress import TaskProgress


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
