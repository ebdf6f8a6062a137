"""Failed runs, kept where an operator (or a mail/chat hook reading the file) will see them.

One JSON line per failed run in <data root>/alerts/run_failures.jsonl. Appending one short line
with O_APPEND is atomic on local file systems, so concurrent sensors never interleave lines.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunFailure:
    run_id: str
    job: str
    partition: str | None
    failed_at: str  # ISO 8601, UTC
    reason: str


def alerts_file(root: Path) -> Path:
    return root / "alerts" / "run_failures.jsonl"


def record_run_failure(root: Path, failure: RunFailure) -> Path:
    path = alerts_file(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(asdict(failure), sort_keys=True) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return path


def read_run_failures(root: Path) -> list[RunFailure]:
    path = alerts_file(root)
    if not path.is_file():
        return []
    return [RunFailure(**json.loads(line)) for line in path.read_text().splitlines() if line]
