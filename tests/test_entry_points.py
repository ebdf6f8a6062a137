"""The console scripts and `python -m fabric_pipelines.cli` still resolve after modules move.

Light: `importlib.util.find_spec` finds the module (importing only its parent packages), and the
attribute is read from the module's source with `ast`, so Dagster and torch are not imported.
"""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _top_level_names(path: Path) -> set[str]:
    """Names a module binds at top level: def, class, assignment, import (incl. under if/try)."""
    body = ast.parse(path.read_text()).body
    names: set[str] = set()
    for node in [*body, *(n for s in body if isinstance(s, ast.If | ast.Try) for n in s.body)]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


@pytest.mark.parametrize(("script", "target"), sorted(SCRIPTS.items()))
def test_console_script_resolves(script: str, target: str) -> None:
    module, _, attribute = target.partition(":")
    spec = importlib.util.find_spec(module)
    where = f"pyproject.toml [project.scripts] {script} = {target!r}"
    assert spec is not None and spec.origin, (
        f"{where}: no module {module}; point it at the new path"
    )
    assert attribute in _top_level_names(Path(spec.origin)), (
        f"{where}: {spec.origin} defines no top-level {attribute!r}; define or re-export it there"
    )


def test_the_cli_runs_with_python_m() -> None:
    """README runs `python -m fabric_pipelines.cli`: a module, or a package with __main__.py."""
    spec = importlib.util.find_spec("fabric_pipelines.cli")
    assert spec is not None, "fabric_pipelines.cli is gone: `fabric` and `python -m` need it"
    if spec.submodule_search_locations is not None:
        assert importlib.util.find_spec("fabric_pipelines.cli.__main__") is not None, (
            "fabric_pipelines/cli/ is a package without __main__.py: add one that calls "
            "run_command(), so that `python -m fabric_pipelines.cli` keeps working"
        )
