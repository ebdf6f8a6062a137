"""The documents hold together: the README stays a front door (at most 300 lines), every
relative Markdown link in the README, docs/ and bench/README.md reaches an existing file (and,
for a Markdown file, an existing heading), every document a source file mentions exists, and every
code path the documents name exists. Each failure names the file and line and what is missing."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 300


def _documents() -> list[Path]:
    """The project's own Markdown documents."""
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]


# Source files that may mention documents: code, scripts and configuration (not the documents).
SOURCE_DIRS = ("fabric_pipelines", "fabric_gpu", "fabric_testing", "csrc", "tests", "bench",
               "scripts", "deploy", ".ci")  # fmt: skip
SOURCE_FILES = ("pyproject.toml", "Makefile", "CMakeLists.txt", "workspace.yaml")
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _lines_outside_code(path: Path, keep_spans: bool = False) -> Iterator[tuple[int, str]]:
    """(line number, text) of a Markdown file's lines outside fenced code blocks, with inline
    code spans removed unless `keep_spans` (a link written inside code is an example, not a
    link; a heading's code spans count in its anchor)."""
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        marker = line.lstrip()[:3]
        if marker in ("```", "~~~"):
            fence = marker if fence is None else (None if marker == fence else fence)
            continue
        if fence is None:
            yield number, line if keep_spans else re.sub(r"`[^`]*`", "", line)


def _lines_with_code(path: Path) -> Iterator[tuple[int, str]]:
    yield from enumerate(path.read_text(encoding="utf-8").splitlines(), 1)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _lines_outside_code(path, keep_spans=True):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _source_files() -> Iterator[Path]:
    this = Path(__file__).resolve()
    for name in SOURCE_FILES:
        if (ROOT / name).is_file():
            yield ROOT / name
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or path.suffix == ".md" or path.resolve() == this:
                continue
            if SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts):
                continue
            yield path


def _text_lines(path: Path) -> list[str] | None:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, OSError):
        return None  # a binary file (a compiled module, an image)


# [text](target) or [text](target "title"); images too.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A document's path as code and comments write it: README.md, docs/runtime.md, ../ARCHITECTURE.md,
# with an optional #anchor. Not a method call such as `MetadataValue.md(...)`.
DOC_MENTION = re.compile(r"(?<![\w./-])((?:\.{1,2}/)?(?:[\w.-]+/)*[\w-]+\.md)(#[\w-]+)?(?![\w(])")
# Code paths the documents name.
CODE_PATH = re.compile(
    r"(?<![\w./-])((?:fabric_pipelines|fabric_gpu|fabric_testing|csrc|tests|bench|scripts|deploy)"
    r"/[\w./*-]*[\w*/])"
)
LIB_PATH = re.compile(r"(?<![\w./-])((?:lib|cli|defs)/[\w./*-]*[\w*/])")


def _exists(path: Path) -> bool:
    """A file or folder under the repository; a name with `*` (`csrc/runtime.*`) as a pattern."""
    relative = str(path.relative_to(ROOT)).rstrip("/")
    return any(ROOT.glob(relative)) if "*" in relative else path.exists()


def _missing_anchor(target: Path, anchor: str) -> bool:
    return target.suffix == ".md" and anchor not in _anchors(target)


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md: {len(lines)} lines, at most {README_MAX_LINES}: move the detail to docs/ "
        "or bench/README.md and link to it"
    )


def test_every_relative_link_in_the_documents_reaches_a_file() -> None:
    broken = []
    for doc in _documents():
        for number, line in _lines_outside_code(doc):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                path = (doc.parent / file_part).resolve() if file_part else doc
                if not path.exists():
                    broken.append(f"{_rel(doc)}:{number}: {target} (no such file: {file_part})")
                elif anchor and _missing_anchor(path, anchor):
                    broken.append(f"{_rel(doc)}:{number}: {target} (no heading #{anchor})")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_every_document_a_source_file_mentions_exists() -> None:
    dangling = []
    for source in _source_files():
        lines = _text_lines(source)
        if lines is None:
            continue
        for number, line in enumerate(lines, 1):
            for mention, anchor in DOC_MENTION.findall(line):
                candidates = [ROOT / mention, source.parent / mention]
                found = next((c.resolve() for c in candidates if c.is_file()), None)
                if found is None:
                    dangling.append(f"{_rel(source)}:{number}: {mention} (no such document)")
                elif anchor and _missing_anchor(found, anchor[1:]):
                    dangling.append(f"{_rel(source)}:{number}: {mention}{anchor} (no such heading)")
    assert not dangling, "documents mentioned that do not exist:\n" + "\n".join(dangling)


def test_every_code_path_the_documents_name_exists() -> None:
    missing = []
    for doc in _documents():
        for number, line in _lines_with_code(doc):
            found = [(m, ROOT / m) for m in CODE_PATH.findall(line)]
            found += [(m, ROOT / "fabric_pipelines" / m) for m in LIB_PATH.findall(line)]
            for mention, path in found:
                if not _exists(path):
                    missing.append(f"{_rel(doc)}:{number}: {mention} (no such file or folder)")
    assert not missing, "code paths named in the documents that do not exist:\n" + "\n".join(
        missing
    )
