"""Task-set names become file names, partition keys and SQL values: only safe ones get in."""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class InvalidNameError(ValueError):
    pass


def validate_task_set_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidNameError(
            f"task-set name {name!r} is not allowed: use 1-64 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit, with no '..', path separators, quotes or spaces"
        )
    return name
