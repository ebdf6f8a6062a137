"""Content keys for planning (fabric_pipelines/lib/broker/reuse.py): 1,000,000 tasks of
`reference_lengths()` token ids hashed by the compiled hasher (csrc/sha256.cpp) with the CPU's
SHA extensions against its portable C++, both on one thread and on every core, and against
hashlib per key on one thread (the peer `content_keys` replaced; timed on a tenth of the keys
and scaled). Every result is checked equal to the others before it is timed.

    python bench/content_keys.py            # 1,000,000 keys
    python bench/content_keys.py --tasks 200000

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from yardstick import DEFAULT, load_reference

PREFIX = b'{"engine": "cpu/float32", "layers": [], "model_key": "bench@weights:mean"}'


def best_of(repeat: int, call: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3, help="timings per way; the best counts")
    parser.add_argument("--reference", default=str(DEFAULT))
    args = parser.parse_args()

    from fabric_gpu._content_keys import digest_runs, sha_extensions

    lengths = np.asarray(load_reference(args.reference).reference_lengths(args.tasks, max_len=512))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64) * 4  # int32 token ids
    data = np.random.default_rng(0).integers(0, 256, int(offsets[-1]), dtype=np.uint8)
    cores = os.cpu_count() or 1
    print(f"{args.tasks:,} keys over {offsets[-1] / 1e6:.0f} MB; {cores} cores; "
          f"SHA extensions: {sha_extensions()}", flush=True)  # fmt: skip

    ways = {
        "portable": "portable",
        **({"sha-extensions": "sha-extensions"} if sha_extensions() else {}),
    }
    results = {name: digest_runs(PREFIX, data, offsets, 1, way) for name, way in ways.items()}
    assert len(set(results.values())) == 1, "the ways disagree"
    tenth = max(1, args.tasks // 10)
    head = results["portable"][: 32 * tenth]
    peer = b"".join(
        hashlib.sha256(PREFIX + data[a:b].tobytes()).digest()
        for a, b in zip(offsets[:tenth].tolist(), offsets[1 : tenth + 1].tolist(), strict=True)
    )
    assert peer == head, "hashlib disagrees"

    seconds: dict[str, float] = {}
    for name, way in ways.items():
        for threads in (1, 0):
            label = f"{name}/{'1 thread' if threads == 1 else 'every core'}"
            seconds[label] = best_of(
                args.repeat,
                lambda way=way, threads=threads: digest_runs(PREFIX, data, offsets, threads, way),
            )

    def hashlib_tenth() -> None:
        for a, b in zip(offsets[:tenth].tolist(), offsets[1 : tenth + 1].tolist(), strict=True):
            hashlib.sha256(PREFIX + data[a:b].tobytes()).digest()

    seconds["hashlib per key/1 thread"] = best_of(args.repeat, hashlib_tenth) * args.tasks / tenth
    for label, s in seconds.items():
        print(f"  {label:<28} {s:7.3f} s  {args.tasks / s / 1e6:6.2f} M keys/s", flush=True)
    ratios = {}
    if "sha-extensions/1 thread" in seconds:
        ratios = {
            "sha_extensions_vs_portable_1_thread": seconds["sha-extensions/1 thread"] / seconds["portable/1 thread"],
            "sha_extensions_vs_portable_every_core": seconds["sha-extensions/every core"] / seconds["portable/every core"],
            "sha_extensions_every_core_vs_hashlib": seconds["sha-extensions/every core"] / seconds["hashlib per key/1 thread"],
        }  # fmt: skip
        for name, ratio in ratios.items():
            print(f"  {name}: {ratio:.3f}x")
    print(json.dumps({"tasks": args.tasks, "cores": cores, "seconds": {k: round(v, 4) for k, v in seconds.items()},
                      "ratios": {k: round(v, 3) for k, v in ratios.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
