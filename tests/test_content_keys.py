"""The compiled content-key hasher (csrc/sha256.cpp, fabric_gpu._content_keys): hashlib's
sha256, byte for byte, for every length around the block edges, any prefix, one thread or many,
each way of compressing blocks (portable C++, the CPU's SHA extensions), and from several Python
threads at once; bad offsets and unknown implementations are refused, naming what is wrong."""

from __future__ import annotations

import hashlib
import itertools
import json
import threading

import numpy as np
import pytest

from fabric_gpu._content_keys import digest_runs, sha_extensions
from fabric_pipelines.lib.broker.reuse import content_keys, key_bytes

IMPLEMENTATIONS = [
    "auto",
    "portable",
    pytest.param(
        "sha-extensions",
        marks=pytest.mark.skipif(
            not sha_extensions(), reason="this CPU has no SHA extensions (x86 SHA-NI)"
        ),
    ),
]


def _expected(prefix: bytes, data: np.ndarray, offsets: np.ndarray) -> bytes:
    return b"".join(
        hashlib.sha256(prefix + data[a:b].tobytes()).digest()
        for a, b in itertools.pairwise(offsets)
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("prefix_bytes", [0, 1, 14, 55, 56, 63, 64, 65, 200])
def test_every_run_length_hashes_as_hashlib_does(prefix_bytes: int, implementation: str) -> None:
    rng = np.random.default_rng(prefix_bytes)
    prefix = rng.integers(0, 256, prefix_bytes, dtype=np.uint8).tobytes()
    lengths = np.array([*range(0, 300), 447, 448, 511, 512, 513, 4096, 100_000])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data = rng.integers(0, 256, int(offsets[-1]), dtype=np.uint8)
    expected = _expected(prefix, data, offsets)
    for threads in (1, 3, 0):  # 0: every core
        assert digest_runs(prefix, data, offsets, threads, implementation) == expected, threads


def test_runs_may_start_anywhere_and_overlap() -> None:
    data = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz" * 10, dtype=np.uint8)
    offsets = np.array([5, 9, 9, 200], dtype=np.int64)
    assert digest_runs(b"p", data, offsets) == _expected(b"p", data, offsets)


def test_many_keys_on_many_threads_from_two_python_threads_at_once() -> None:
    rng = np.random.default_rng(7)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 200, 50_000))]).astype(np.int64)
    data = rng.integers(0, 256, int(offsets[-1]), dtype=np.uint8)
    expected = _expected(b"head", data, offsets)
    results: list[bytes] = []
    start = threading.Barrier(2)

    def hash_all() -> None:
        start.wait()
        results.append(digest_runs(b"head", data, offsets, 8))

    threads = [threading.Thread(target=hash_all) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected, expected]


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([], "needs n \\+ 1 entries"),
        ([-1, 2], "must not be negative"),
        ([0, 5, 3], "must not decrease \\(run 1\\)"),
        ([0, 11], "run past the end of the data"),
    ],
)
def test_bad_offsets_are_refused_naming_the_problem(offsets: list[int], message: str) -> None:
    data = np.zeros(10, dtype=np.uint8)
    with pytest.raises(ValueError, match=message):
        digest_runs(b"", data, np.array(offsets, dtype=np.int64))


def test_an_unknown_implementation_is_refused_naming_the_choices() -> None:
    data = np.zeros(10, dtype=np.uint8)
    offsets = np.array([0, 10], dtype=np.int64)
    with pytest.raises(ValueError, match="'sha-ni': choose 'auto', 'portable' or 'sha-extensions'"):
        digest_runs(b"", data, offsets, 0, "sha-ni")
    if not sha_extensions():
        with pytest.raises(ValueError, match="no SHA extensions"):
            digest_runs(b"", data, offsets, 0, "sha-extensions")


def test_content_keys_are_the_documented_sha256() -> None:
    """sha256 of the header JSON (sorted keys) then the task's token ids as little-endian int32,
    with the engine where one is given."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 130, 5000)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0, 30_000, int(offsets[-1]), dtype=np.int32)
    keys = key_bytes(content_keys(tokens, offsets, "m@x:mean", (2, -1), "torch/float16/sm90"))
    header = {"engine": "torch/float16/sm90", "layers": [2, -1], "model_key": "m@x:mean"}
    head = json.dumps(header, sort_keys=True).encode()
    for i in (0, 1, 2500, 4999):
        row = tokens[offsets[i] : offsets[i + 1]].astype("<i4").tobytes()
        assert keys[i] == hashlib.sha256(head + row).digest(), i
