"""Task-set names become file names, partition keys and SQL values: only safe ones get in.

Only letters, digits, '_', '-' and '.' are allowed, so path separators, '..', quotes, spaces, NUL
and other control characters, and SQL or shell metacharacters never reach a path or a query.
"""

from __future__ import annotations

import re

PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_NAME = re.compile(PATTERN)
_ALLOWED = re.compile(r"[A-Za-z0-9_.-]")


class InvalidNameError(ValueError):
    pass


def validate_task_set_name(name: object) -> str:
    """`name` if it is a safe task-set name; InvalidNameError naming what is wrong otherwise."""
    if not isinstance(name, str):
        problem = f"it is {type(name).__name__}, not text"
    elif not name:
        problem = "it is empty"
    elif len(name) > 64:
        problem = f"it has {len(name)} characters, more than 64"
    elif bad := next((c for c in name if not _ALLOWED.fullmatch(c)), None):
        problem = f"{bad!r} at position {name.index(bad)} is not allowed"
    elif not name[0].isalnum():
        problem = "it must start with a letter or digit"
    elif ".." in name:
        problem = "it contains '..'"
    elif _NAME.fullmatch(name):
        return name
    else:
        problem = "it does not match the pattern"
    shown = repr(name)[:80]
    raise InvalidNameError(
        f"task-set name {shown} is not allowed ({problem}): use 1-64 letters, digits, '_', '-' "
        f"or '.', starting with a letter or digit, with no '..' (the pattern {PATTERN}); path "
        "separators, quotes, spaces, control characters and SQL metacharacters are refused"
    )
