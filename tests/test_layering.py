"""The layers import downwards only: `lib/store` is the ground floor of `lib`, no two parts of
`lib` import each other (directly or round about), `lib` never reaches up into the Dagster
definitions, and `fabric_gpu` knows nothing of the pipelines. Imports inside functions count."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIB = "fabric_pipelines.lib"


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _imports(package: str) -> list[tuple[str, str, str]]:
    """(importing module, imported module, where) for every import in `package`."""
    found = []
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            found += [(module, n, f"{path.relative_to(ROOT)}:{node.lineno}") for n in names]
    return found


def _part(module: str) -> str:
    """The part of lib a module belongs to: its subpackage, or the top-level module itself."""
    return ".".join(module.split(".")[:3])


def test_the_store_imports_nothing_from_the_rest_of_lib() -> None:
    upward = [
        f"{where}: {imported}"
        for module, imported, where in _imports(f"{LIB}.store")
        if imported.startswith(LIB + ".") and not imported.startswith(f"{LIB}.store")
    ]
    assert upward == [], "lib/store is the ground floor:\n" + "\n".join(upward)


def test_no_two_parts_of_lib_import_each_other() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, imported, _ in _imports(LIB):
        if imported.startswith(LIB + ".") and _part(imported) != _part(module):
            graph[_part(module)].add(_part(imported))

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a) and a < b)
    assert cycles == [], "import cycles between parts of lib:\n" + "\n".join(cycles)


def test_lib_never_imports_the_definitions_and_fabric_gpu_never_the_pipelines() -> None:
    wrong = [
        f"{where}: {imported}"
        for module, imported, where in _imports(LIB)
        if imported.startswith("fabric_pipelines.defs")
    ]
    wrong += [
        f"{where}: {imported}"
        for module, imported, where in _imports("fabric_gpu")
        if imported.startswith("fabric_pipelines")
    ]
    assert wrong == [], "\n".join(wrong)
