"""The one file-writing helper under concurrency: no shared staging names, hashes that describe
the bytes on disk, nothing left behind."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import numpy as np
import pytest

from fabric_pipelines.lib.files import (
    CorruptFileError,
    sha256_file,
    verify_sha256,
    write_bytes,
    write_content_addressed,
    write_file,
)
from fabric_pipelines.lib.store.shards import read_shard, write_shard

CALLS_PER_THREAD = 150
HIDDEN = 8


def _shard_inputs(thread: int, call: int) -> tuple[list[str], np.ndarray, dict[int, np.ndarray]]:
    rng = np.random.default_rng(thread * 100_000 + call)
    n = int(rng.integers(1, 6))
    ids = [f"t{thread}-c{call}-i{i}" for i in range(n)]
    lengths = rng.integers(1, 9, size=n)
    states = rng.standard_normal((int(lengths.sum()), HIDDEN)).astype(np.float16)
    return ids, lengths, {-1: states}


def test_two_threads_writing_shards_at_once_never_mix_their_files(tmp_path: Path) -> None:
    """Acceptance: two writer threads x 150 calls, 0 errors, each hash its own content and ids."""
    results: dict[tuple[int, int], object] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def writer(thread: int) -> None:
        start.wait()
        for call in range(CALLS_PER_THREAD):
            ids, lengths, hooks = _shard_inputs(thread, call)
            try:
                results[(thread, call)] = write_shard(tmp_path, ids, lengths, hooks, HIDDEN)
            except BaseException as error:  # every error counts against the test
                errors.append(error)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    assert len(results) == 2 * CALLS_PER_THREAD
    for (thread, call), shard in results.items():
        ids, lengths, hooks = _shard_inputs(thread, call)
        assert sha256_file(shard.path) == shard.sha256  # type: ignore[attr-defined]
        content = read_shard(shard.path, shard.sha256)  # type: ignore[attr-defined]
        assert content["task_id"] == ids
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for i, states in enumerate(content["layer_-1"]):
            np.testing.assert_array_equal(states, hooks[-1][offsets[i] : offsets[i + 1]])
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()], "staging files left behind"


def _write_many(folder: str, worker: int, count: int) -> list[tuple[str, str]]:
    out = []
    for i in range(count):
        data = f"process {worker} file {i} ".encode() * (i + 1)
        stored = write_content_addressed(
            Path(folder), ".bin", lambda tmp, d=data: tmp.write_bytes(d)
        )
        out.append((str(stored.path), stored.sha256))
    return out


def test_processes_writing_one_folder_at_once_each_get_their_own_content(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        written = pool.starmap(_write_many, [(str(tmp_path), w, 60) for w in range(2)])
    for worker, files in enumerate(written):
        for i, (path, sha) in enumerate(files):
            assert Path(path).read_bytes() == f"process {worker} file {i} ".encode() * (i + 1)
            assert sha256_file(Path(path)) == sha
    assert not list(tmp_path.glob(".*"))


def test_same_path_written_by_two_threads_ends_as_one_whole_version(tmp_path: Path) -> None:
    target = tmp_path / "receipt.json"
    versions = [bytes([65 + v]) * 100_000 for v in range(2)]
    shas: list[str] = []

    def writer(v: int) -> None:
        for _ in range(50):
            shas.append(write_bytes(target, versions[v]).sha256)

    threads = [threading.Thread(target=writer, args=(v,)) for v in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.read_bytes() in versions  # never a mix of the two
    import hashlib

    assert set(shas) == {hashlib.sha256(v).hexdigest() for v in versions}
    assert list(tmp_path.iterdir()) == [target]


def test_a_failing_write_leaves_neither_the_target_nor_a_staging_file(tmp_path: Path) -> None:
    target = tmp_path / "index.faiss"

    def half_then_fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file(target, half_then_fail)
    assert list(tmp_path.iterdir()) == []


def test_verify_names_the_file_and_both_hashes(tmp_path: Path) -> None:
    stored = write_bytes(tmp_path / "plan.arrow", b"abc")
    verify_sha256(stored.path, stored.sha256, "plan", "re-plan")
    stored.path.write_bytes(b"abd")
    with pytest.raises(
        CorruptFileError, match=r"plan .*plan\.arrow is corrupt: sha256 [0-9a-f]{64}"
    ):
        verify_sha256(stored.path, stored.sha256, "plan", "re-plan")
    stored.path.unlink()
    with pytest.raises(FileNotFoundError, match="missing; re-plan"):
        verify_sha256(stored.path, stored.sha256, "plan", "re-plan")


def test_an_unusable_folder_is_named_with_what_to_do(tmp_path: Path) -> None:
    blocked = tmp_path / "shards"
    blocked.write_bytes(b"a file where the folder should be")
    with pytest.raises(
        OSError, match=r"cannot store files in .*shards: .*make it a writable folder"
    ):
        write_bytes(blocked / "x.arrow", b"data")
