"""A progress bar over a task set's finished tasks, for people watching a terminal.

Shown only when stderr is a terminal (the `fabric` commands); in the Dagster UI the same
progress arrives as log lines and asset observations instead.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from fabric_pipelines.lib.broker.ledger import Accounting


class TaskProgress:
    def __init__(self, desc: str, enabled: bool | None = None) -> None:
        self.desc = desc
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.bar: tqdm | None = None

    def update(self, counts: Accounting) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = tqdm(total=counts.tasks, desc=self.desc, unit="task", dynamic_ncols=True)
        self.bar.n = counts.completed + counts.failed
        self.bar.set_postfix(failed=counts.failed, in_flight=counts.in_flight, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
