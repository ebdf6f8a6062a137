"""The product's import layering, read from the source with `ast` (nothing is imported).

The product is `fabric_pipelines` and `fabric_gpu`; `fabric_testing/` (when present) is a test
harness beside it. Every reference counts: `import a.b`; `from a.b import c` (an edge to the
module `a.b.c` when that file exists, else to `a.b`, i.e. its `__init__`); relative imports;
imports inside functions and under `if TYPE_CHECKING:`; `importlib.import_module("...")` and
`__import__("...")`; and any string literal that is exactly the dotted name of one of our modules
(a `python -m` target, a preload list; `f"{__name__}.main"` too). Those last ones are shown as
`(string ...)` in the messages: they are not imports, but they tie the modules together as much.

Rules (a test each; rule 6 has two):
 1. No import cycle between modules (strongly connected components of the whole graph). A package
    `__init__` importing or re-exporting its own submodules is not an edge.
 2. Nothing under `fabric_pipelines.lib` imports `fabric_pipelines.{cli,defs,definitions}`,
    `dagster` or `dagster_*`: Dagster stays in `defs/` and `cli/`. One exception: a worker
    process reports through `dagster_pipes` (lib/worker/reporting.py), Pipes' side for the
    external process, which does not import Dagster.
 3. `fabric_gpu` never imports `fabric_pipelines`.
 4. No product module imports `fabric_testing`, `tests` or `bench`.
 5. `lib/` holds subpackages only, plus its `__init__.py`.
 6. FLOORS orders lib's subpackages, bottom first. A module of package P imports lib modules of P
    or of packages on a strictly lower tier. Every subpackage of lib is listed in FLOORS.
 7. Above lib, LAYERS (bottom first): `defs`, `definitions` and `cli` import only their own part
    or lower ones; every module of `fabric_pipelines` is in a layer.
 8. No public top-level class or function name is defined in two product modules (migrations
    aside), unless ALLOWED_DUPLICATES says why.
 9. A dotted name under our packages, in an import or a string, names a module that exists (a
    stale `-m` target after a move fails here, not at run time).

FABRIC_LAYERING_ROOT=/path/to/checkout checks another checkout.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("FABRIC_LAYERING_ROOT") or Path(__file__).resolve().parent.parent)
PRODUCT = ("fabric_pipelines", "fabric_gpu")
HARNESS = "fabric_testing"
NOT_FOR_PRODUCT = ("fabric_testing", "tests", "bench")
LIB = "fabric_pipelines.lib"
ABOVE_LIB = ("fabric_pipelines.cli", "fabric_pipelines.defs", "fabric_pipelines.definitions")

# lib's subpackages, bottom tier first (tentative: adjust to the real imports after the move).
FLOORS: list[list[str]] = [  # docs/architecture.md's table, bottom first
    ["core"],
    ["store"],
    ["tasks", "records"],
    ["broker"],
    ["index", "results"],
    ["worker", "maintenance"],
    ["steps"],
]
# The parts of the product, bottom first; each imports only its own part or lower tiers.
LAYERS: list[list[str]] = [
    ["fabric_gpu"],
    [LIB],
    ["fabric_pipelines.defs"],
    ["fabric_pipelines.definitions"],
    ["fabric_pipelines.cli"],
]
# Public top-level names that may be defined in several modules: name -> the one-line reason.
ALLOWED_DUPLICATES: dict[str, str] = {
    "main": "the entry function of each `python -m` module (worker child, pool server, cli, ...)",
}
_DOTTED = re.compile(rf"({'|'.join([*PRODUCT, HARNESS])})(\.[A-Za-z_]\w*)+")


@dataclass(frozen=True)
class Ref:
    source: str  # the referring module
    written: str  # the absolute dotted name as written (for `from a import b`: a.b or a)
    target: str  # the module of ours it lands on (longest existing prefix), else `written`
    where: str  # path:line
    kind: str  # "import" or "string"

    def __str__(self) -> str:
        how = f' (string "{self.written}")' if self.kind == "string" else ""
        return f"{self.where}: {self.source} -> {self.target}{how}"


@dataclass
class ImportGraph:
    modules: dict[str, Path]  # our modules: dotted name -> file
    packages: set[str]  # those that are a package's __init__
    known: set[str]  # modules plus compiled ones (.pyi stubs)
    refs: list[Ref]

    def edges(self) -> dict[str, dict[str, list[Ref]]]:
        """source -> target -> refs, between our modules, minus a package's edges to its own
        submodules (re-exports)."""
        out: dict[str, dict[str, list[Ref]]] = defaultdict(lambda: defaultdict(list))
        for ref in self.refs:
            inside = ref.source in self.packages and ref.target.startswith(ref.source + ".")
            if ref.target in self.modules and not inside:
                out[ref.source][ref.target].append(ref)
        return out


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of `name` that is a module of ours, else `name` itself."""
    parts = name.split(".")
    return next(
        (m for n in range(len(parts), 0, -1) if (m := ".".join(parts[:n])) in modules), name
    )


def _string(node: ast.AST, module: str) -> str | None:
    """A string literal's value; an f-string only when built from `__name__` and constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        text = ""
        for part in node.values:
            if isinstance(part, ast.Constant):
                text += str(part.value)
            elif isinstance(part.value, ast.Name) and part.value.id == "__name__":
                text += module
            else:
                return None
        return text
    return None


def _refs(module: str, path: Path, is_package: bool, g: ImportGraph) -> list[Ref]:
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[ast.AST, str, str]] = []
    taken: set[int] = set()  # string nodes already read as import_module arguments
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node, alias.name, "import") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from ..x import y` in a.b.c is a.x.y
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            for alias in node.names:  # `from a import b` names the module a.b, if there is one
                sub = f"{base}.{alias.name}"
                found.append((node, sub if sub in g.known else base, "import"))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            name = _string(node.args[0], module)
            if callee in ("import_module", "__import__") and name and not name.startswith("."):
                taken.add(id(node.args[0]))
                found.append((node, name, "import"))
        elif id(node) not in taken and (text := _string(node, module)) and _DOTTED.fullmatch(text):
            found.append((node, text, "string"))
    rel = path.relative_to(ROOT)
    refs = []
    for node, name, kind in found:
        exact = kind == "string" and name not in g.modules
        target = name if exact else _resolve(name, g.modules)
        if target != module:
            refs.append(Ref(module, name, target, f"{rel}:{getattr(node, 'lineno', 0)}", kind))
    return list(dict.fromkeys(refs))  # one per line and target: `from a import b, c` is one


@functools.cache
def graph() -> ImportGraph:
    g = ImportGraph({}, set(), set(), [])
    for top in (*PRODUCT, HARNESS):
        for path in sorted((ROOT / top).rglob("*.py*")):
            if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            g.known.add(name)
            if path.suffix == ".py":
                g.modules[name] = path
                if path.name == "__init__.py":
                    g.packages.add(name)
    for name, path in g.modules.items():
        g.refs += _refs(name, path, name in g.packages, g)
    return g


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _where(module: str) -> str:
    return f"{graph().modules[module].relative_to(ROOT)}:1: {module}"


def _check(wrong: list, what_to_do: str) -> None:
    """Fail with what to do and every offending file:line (not with pytest's diff)."""
    if wrong:
        pytest.fail(f"{what_to_do}:\n  " + "\n  ".join(sorted(map(str, wrong))), pytrace=False)


def _sccs(edges: dict[str, dict[str, list[Ref]]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_cycles() -> None:
    edges = graph().edges()
    cycles = [
        f"cycle among {', '.join(scc)}:\n    "
        + "\n    ".join(sorted(str(r) for a in scc for b in scc for r in edges[a].get(b, [])))
        for scc in _sccs(edges)
    ]
    _check(
        cycles,
        "Import cycles. Break each by moving what both sides need down into a lower "
        "module, or the caller up (a string edge counts: it loads the module too)",
    )


PIPES_REPORTER = "fabric_pipelines.lib.worker.reporting"  # rule 2's one exception


def test_lib_imports_neither_dagster_nor_the_definitions_nor_the_cli() -> None:
    wrong = [
        r
        for r in graph().refs
        if _under(r.source, LIB)
        and (_under(r.target, *ABOVE_LIB) or re.match(r"dagster(_\w+)?(\.|$)", r.written))
        and not (r.written == "dagster_pipes" and r.source == PIPES_REPORTER)
    ]
    _check(
        wrong,
        "lib/ reaches up into Dagster, defs/, definitions or cli/. Move that code up "
        "into defs/ or cli/, or have the caller pass in what it needs",
    )


def test_fabric_gpu_never_imports_the_pipelines() -> None:
    wrong = [
        r
        for r in graph().refs
        if _under(r.source, "fabric_gpu") and _under(r.written, "fabric_pipelines")
    ]
    _check(
        wrong,
        "fabric_gpu knows nothing of fabric_pipelines: move the shared code into "
        "fabric_gpu, or have the caller pass it in",
    )


def test_the_product_never_imports_the_test_harness() -> None:
    wrong = [
        r
        for r in graph().refs
        if _under(r.source, *PRODUCT) and _under(r.written, *NOT_FOR_PRODUCT)
    ]
    _check(
        wrong,
        "Product code imports fabric_testing/tests/bench, which are not in the wheel: "
        "move what it needs into the product, or the importing code into the harness",
    )


def test_lib_has_no_flat_modules() -> None:
    g = graph()
    flat = [
        _where(m) for m in g.modules if _under(m, LIB) and m.count(".") == 2 and m not in g.packages
    ]
    _check(
        flat,
        "Modules left directly in fabric_pipelines/lib/: move each into its subpackage "
        "(the target layout names it), and add the subpackage to FLOORS",
    )


def _floor(package: str | None) -> int | None:
    return next((i for i, tier in enumerate(FLOORS) if package in tier), None)


def _lib_package(module: str) -> str | None:
    """`index` for fabric_pipelines.lib.index(.x); None for lib itself and for flat modules."""
    parts = module.split(".")
    in_package = len(parts) > 3 or module in graph().packages
    return parts[2] if _under(module, LIB) and len(parts) > 2 and in_package else None


def test_every_lib_subpackage_has_a_floor() -> None:
    missing = [
        _where(p)
        for p in graph().packages
        if _under(p, LIB) and p.count(".") == 2 and _floor(p.split(".")[2]) is None
    ]
    _check(
        missing,
        "lib subpackages missing from FLOORS in tests/test_layering.py: add each to "
        "the tier above everything it imports and below everything that imports it",
    )


def test_lib_imports_only_lower_floors() -> None:
    wrong = []
    for r in graph().refs:
        mine, theirs = _lib_package(r.source), _lib_package(r.target)
        outside = r.target not in graph().modules or not _under(r.target, LIB) or r.target == LIB
        if mine in (None, theirs) or outside:
            continue
        if theirs is None:
            wrong.append(f"{r}: a flat lib module; move it into its subpackage")
        elif None not in (_floor(mine), _floor(theirs)) and _floor(theirs) >= _floor(mine):
            wrong.append(f"{r}: {mine} (tier {_floor(mine)}) -> {theirs} (tier {_floor(theirs)})")
    _check(
        wrong,
        "lib imports sideways or upward between its subpackages. Move the shared code "
        "down a floor, or, if FLOORS has the real order wrong, change FLOORS",
    )


def _layer(module: str) -> int | None:
    hits = [(len(p), i) for i, tier in enumerate(LAYERS) for p in tier if _under(module, p)]
    return max(hits)[1] if hits else None


def test_the_parts_above_lib_import_downward() -> None:
    g = graph()
    wrong = [
        f"{_where(m)} is in no part of LAYERS: add its part, or move it"
        for m in g.modules
        if _under(m, "fabric_pipelines") and m != "fabric_pipelines" and _layer(m) is None
    ]
    for r in g.refs:
        mine, theirs = _layer(r.source), _layer(r.target)
        if _under(r.source, *ABOVE_LIB) and None not in (mine, theirs) and theirs > mine:
            wrong.append(f"{r}: {LAYERS[mine]} may not import {LAYERS[theirs]}")
    _check(
        wrong,
        f"Parts above lib import upward (LAYERS, bottom first: {LAYERS}). Move the "
        "code down, or the caller up",
    )


def test_no_public_name_is_defined_in_two_modules() -> None:
    assert all(reason.strip() for reason in ALLOWED_DUPLICATES.values()), "give each its reason"
    places: dict[str, dict[Path, int]] = defaultdict(dict)  # name -> file -> line
    for module, path in graph().modules.items():
        if _under(module, *PRODUCT) and "migrations" not in path.parts:
            body = ast.parse(path.read_text()).body
            for node in [
                *body,
                *(n for s in body if isinstance(s, ast.If | ast.Try) for n in s.body),
            ]:
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    places[node.name].setdefault(path.relative_to(ROOT), node.lineno)
    twice = [
        f"{name}: " + ", ".join(f"{path}:{line}" for path, line in where.items())
        for name, where in places.items()
        if len(where) > 1 and not name.startswith("_") and name not in ALLOWED_DUPLICATES
    ]
    _check(
        twice,
        "Public names defined in several modules. Rename one so that each says what "
        "it is (LaunchSettings / LoopSettings), or add it to ALLOWED_DUPLICATES with a reason",
    )


def test_dotted_names_of_ours_name_real_modules() -> None:
    g = graph()
    stale = [
        f"{r}: no such module"
        for r in g.refs
        if r.written not in g.known and _DOTTED.fullmatch(r.written)
    ]
    _check(
        stale,
        "Imports or strings name a module of ours that does not exist (moved?). Point "
        "them at the new path, or derive them from the code: MAIN_MODULE = f'{__name__}.main'",
    )
