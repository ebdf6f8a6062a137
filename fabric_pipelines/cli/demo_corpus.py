"""The demo's task set: docstrings of the installed Python standard library, plus bad items.

Real text of varied length that the project does not ship: every module, class and function
docstring found by parsing (never importing) the standard library's source files, in a fixed
order. A few deliberately bad records show how failures come back.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from fabric_pipelines.lib.core.files import write_bytes

# Folders of the standard library that hold tests or vendored code, not documentation.
SKIP_PARTS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "lib2to3",
    "__pycache__",
}

BAD_RECORDS: list[dict[str, object]] = [
    {"id": "bad-empty", "text": ""},
    {"id": "bad-whitespace", "text": "   \n\t  "},
    {"id": "bad-type", "text": 42},
    {"text": "a record without an id"},
    {"id": "bad-overlong", "text": "token " * 2000},
]


def stdlib_docstrings(limit: int) -> Iterator[tuple[str, str]]:
    """(id, docstring) pairs, at most `limit`, in a deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    count = 0
    for path in sorted(root.rglob("*.py")):
        if SKIP_PARTS.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(tree):
            if not isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            ):
                continue
            doc = ast.get_docstring(node, clean=True)
            if not doc or len(doc.split()) < 3:
                continue
            name = getattr(node, "name", "") if not isinstance(node, ast.Module) else ""
            line = getattr(node, "lineno", 0)
            yield f"{module}:{name or '<module>'}:{line}", doc
            count += 1
            if count >= limit:
                return


def write_demo_set(path: Path, n_items: int = 3000) -> int:
    """Write the demo JSONL (docstrings, then the bad records and one duplicate id)."""
    records: list[dict[str, object]] = [
        {"id": task_id, "text": text} for task_id, text in stdlib_docstrings(n_items)
    ]
    if len(records) < min(n_items, 2000):
        raise RuntimeError(f"found only {len(records)} docstrings in the standard library")
    records.extend(BAD_RECORDS)
    records.append({"id": records[0]["id"], "text": "a second record reusing the first id"})
    lines = [json.dumps(record, ensure_ascii=False) + "\n" for record in records]
    lines.append('{"id": "bad-json", "text": "unterminated\n')
    write_bytes(path, "".join(lines).encode("utf-8"))
    return len(records) + 1
