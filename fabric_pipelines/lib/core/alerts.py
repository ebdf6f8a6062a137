"""Failed runs and refused inbox files, kept where an operator (or a mail/chat hook reading the
files) will see them.

One JSON line per failed run in <data root>/alerts/run_failures.jsonl, and one per inbox file
the inbox sensor refuses in <data root>/alerts/inbox_rejections.jsonl (once per file version:
the sensor looks every 15 s and must not say it again each time). Appending one short line with
O_APPEND is atomic on local file systems, so concurrent sensors never interleave lines.
"""

from __future__ import annotations

import contextlib
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
    return _append(alerts_file(root), asdict(failure))


@dataclass(frozen=True)
class InboxRejection:
    file: str  # its name in the inbox
    version: str  # size and modification time: a file replaced under the same name is new
    reason: str
    seen_at: str  # ISO 8601, UTC


def rejections_file(root: Path) -> Path:
    return root / "alerts" / "inbox_rejections.jsonl"


def record_inbox_rejection(root: Path, rejection: InboxRejection) -> bool:
    """Append the rejection unless this version of the file was recorded already; True when
    it is new (the caller says so once, visibly)."""
    path = rejections_file(root)
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                known = json.loads(line)
                if (known.get("file"), known.get("version")) == (rejection.file, rejection.version):
                    return False
    _append(path, asdict(rejection))
    return True


def _append(path: Path, record: dict[str, object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
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
