"""The one file-writing helper under concurrency: no shared staging names, hashes that describe
the bytes on disk (streamed ones included: FAISS indexes are hashed as they are written, never
read back), nothing left behind."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest

from fabric_pipelines.lib.core import files as files_module
from fabric_pipelines.lib.core.files import (
    CorruptFileError,
    HashingWriter,
    copy_file,
    sha256_file,
    stream_content_addressed,
    stream_file,
    verify_sha256,
    write_bytes,
    write_content_addressed,
    write_file,
)
from fabric_pipelines.lib.index.build import index_sha256, serialize
from fabric_pipelines.lib.index.index_file import ivf_flat_pieces, store_index
from fabric_pipelines.lib.results.hidden_states import read_shard, write_shard

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


def _pieces(seed: int) -> list[bytes | bytearray | memoryview]:
    """Chunks of every kind and size a streaming writer hands over: small ones between large
    ones (hashed beside the write), and buffers their owner may reuse."""
    rng = np.random.default_rng(seed)
    out: list[bytes | bytearray | memoryview] = []
    for i in range(24):
        size = int(rng.choice([0, 3, 4096, (1 << 20) - 1, 1 << 20, 3 << 20]))
        data = rng.bytes(size)
        out.append([data, bytearray(data), memoryview(data)][i % 3])
    return out


def test_a_streamed_file_records_the_sha256_of_the_bytes_on_disk(tmp_path: Path) -> None:
    import hashlib

    def write_then_reuse(out: HashingWriter, pieces: list[bytes | bytearray | memoryview]) -> None:
        for piece in pieces:
            out.write(piece)
            if isinstance(piece, bytearray):  # its owner reuses it once `write` returns
                piece[:] = bytes(len(piece))

    for seed in range(3):
        pieces = _pieces(seed)
        expected = b"".join(bytes(p) for p in pieces)
        stored = stream_file(
            tmp_path / f"{seed}.bin", lambda out, p=pieces: write_then_reuse(out, p)
        )
        assert stored.path.read_bytes() == expected
        assert stored.sha256 == sha256_file(stored.path) == hashlib.sha256(expected).hexdigest()
        assert stored.bytes == len(expected)
    small = write_bytes(tmp_path / "small.json", b"{}")
    assert small.sha256 == sha256_file(small.path) and small.bytes == 2
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"0.bin", "1.bin", "2.bin", "small.json"}  # no staging file left


def test_a_copied_file_is_the_source_byte_for_byte_with_its_sha256(tmp_path: Path) -> None:
    """A submitted file is copied in chunks (larger than one and not a multiple of it), hashed
    as it is written."""
    import hashlib

    data = np.random.default_rng(0).bytes((8 << 20) * 2 + 12345)
    source = tmp_path / "source.parquet"
    source.write_bytes(data)
    (tmp_path / "inbox").mkdir()
    stored = copy_file(source, tmp_path / "inbox" / "set.parquet")
    assert stored.path.read_bytes() == data and stored.bytes == len(data)
    assert stored.sha256 == hashlib.sha256(data).hexdigest() == sha256_file(stored.path)
    assert [p.name for p in (tmp_path / "inbox").iterdir()] == ["set.parquet"]


def test_a_stream_failing_half_way_leaves_neither_the_target_nor_a_staging_file(
    tmp_path: Path,
) -> None:
    def half_then_fail(out: HashingWriter) -> None:
        out.write(b"x" * (3 << 20))  # hashed on the writer's own thread
        out.write(b"y" * 10)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        stream_content_addressed(tmp_path / "shards", ".faiss", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        stream_file(tmp_path / "index.faiss", half_then_fail)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_file_written_around_the_stream_is_refused(tmp_path: Path) -> None:
    """The hash covers what went through the stream; a writer that bypasses it would get a hash
    that does not describe the file, so the file is not stored."""

    def around(out: HashingWriter) -> None:
        out.write(b"s" * 65536)  # larger than the file's buffer: on disk at once
        for staged in tmp_path.glob(".*staging*"):
            with open(staged, "ab") as other:
                other.write(b"around it")

    with pytest.raises(OSError, match="were streamed into it"):
        stream_file(tmp_path / "out.bin", around)
    assert list(tmp_path.iterdir()) == []


def _ivf(rows: int = 3000, dim: int = 32, nlist: int = 16) -> faiss.Index:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    index = faiss.IndexIVFFlat(faiss.IndexFlatL2(dim), dim, nlist)
    index.train(x)
    index.add(x)
    return index


def test_a_stored_index_is_what_faiss_writes_and_hashes_to_its_name(tmp_path: Path) -> None:
    index = _ivf()
    sha, path = store_index(tmp_path, index)
    assert path == tmp_path / f"{sha}.faiss"
    assert path.read_bytes() == serialize(index)
    assert sha == sha256_file(path) == index_sha256(index)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_an_index_write_failing_half_way_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FAISS calls back into the stream (an IVF-PQ index); an error there (a full disk) ends its
    write, and nothing is left in the folder."""
    real_write = HashingWriter.write

    def fails_after_a_while(self: HashingWriter, chunk: bytes) -> int:
        if self.bytes_written > 100_000:
            raise OSError("disk full")
        return real_write(self, chunk)

    monkeypatch.setattr(HashingWriter, "write", fails_after_a_while)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20_000, 32), dtype=np.float32)  # 320 KB of codes and ids
    index = faiss.IndexIVFPQ(faiss.IndexFlatL2(32), 32, 16, 8, 8)
    index.train(x)
    index.add(x)
    assert ivf_flat_pieces(index) is None  # streamed by FAISS
    with pytest.raises((OSError, RuntimeError)):
        store_index(tmp_path / "shards", index)
    assert list((tmp_path / "shards").iterdir()) == []


def test_an_ivf_flat_index_is_written_in_pieces_as_faiss_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An IVF-Flat index is written from its own lists on several threads: the same bytes FAISS
    writes, lists full or sparse; a write failing half way (a full disk) leaves nothing."""
    sparse = faiss.IndexIVFFlat(faiss.IndexFlatL2(32), 32, 16)
    sparse.train(np.random.default_rng(1).standard_normal((3000, 32), dtype=np.float32))
    sparse.add(np.random.default_rng(2).standard_normal((3, 32), dtype=np.float32))
    for index in (_ivf(), sparse):  # most lists hold rows; three at most do
        pieces = ivf_flat_pieces(index)
        assert pieces is not None
        assert b"".join(bytes(p) for p in pieces) == serialize(index)
    index = _ivf(rows=20_000, dim=64)
    monkeypatch.setattr(files_module, "PIECE_BYTES", 1 << 16)  # many runs, so many writers at once
    calls = 0
    real_pwrite = os.pwrite

    def fails_after_a_while(fd: int, data: Any, offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls > 20:
            raise OSError("disk full")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(files_module.os, "pwrite", fails_after_a_while)
    with pytest.raises(OSError, match="disk full"):
        store_index(tmp_path / "indexes", index)
    assert list((tmp_path / "indexes").iterdir()) == []
    monkeypatch.setattr(files_module.os, "pwrite", real_pwrite)
    sha, path = store_index(tmp_path / "indexes", index)
    assert path.read_bytes() == serialize(index) and sha == sha256_file(path)


def test_two_threads_storing_the_same_index_at_once_both_succeed(tmp_path: Path) -> None:
    index = _ivf(rows=20_000, dim=64)  # 5 MB: large chunks, hashed beside the write
    expected = index_sha256(index)
    results: list[tuple[str, Path]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def writer() -> None:
        start.wait()
        for _ in range(5):
            try:
                results.append(store_index(tmp_path, index))
            except BaseException as error:  # every error counts against the test
                errors.append(error)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [(expected, tmp_path / f"{expected}.faiss")] * 10
    assert sha256_file(tmp_path / f"{expected}.faiss") == expected
    assert [p.name for p in tmp_path.iterdir()] == [f"{expected}.faiss"]  # no staging file left
