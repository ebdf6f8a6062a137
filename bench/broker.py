"""Batch planning speed and padding, against a straightforward pure-Python packer, same input.

Lengths come from the yardstick's `reference_lengths(N)` (lognormal, mean ~100, in [8, 512]).
Profile: max_batch_tokens 32,768, max_batch_items 1,024, max_seq_len 512, granularity 8.
  - ours: `plan_batches` (vectorised NumPy: radix sort by length, even split per bucket);
  - peer: the same bucketing written as a plain Python loop over items (sort by padded length,
    then fill batches item by item within the limits);
  - also: the padding floor that rounding to the granularity imposes, and naive arrival-order
    batches of 64 padded to their longest.

    .venv/bin/python bench/broker.py [--tasks 10000000] [--reference PATH]

Each side is timed as the best of a few runs (ours 3, Python 2). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from yardstick import DEFAULT, load_reference

from fabric_gpu.batching import plan_batches
from fabric_gpu.profile import ConsumerProfile

PROFILE = ConsumerProfile(32768, 1024, 512, 8)


def python_packer(lengths: list[int], profile: ConsumerProfile) -> list[list[int]]:
    """The obvious loop: sort by padded length, fill each batch until a limit would break."""
    g = profile.seq_granularity
    padded = [-(-n // g) * g for n in lengths]
    order = sorted(range(len(lengths)), key=padded.__getitem__)
    batches: list[list[int]] = []
    current: list[int] = []
    current_len = 0
    for i in order:
        length = padded[i]
        if current and (
            length != current_len
            or len(current) + 1 > profile.max_batch_items
            or (len(current) + 1) * length > profile.max_batch_tokens
        ):
            batches.append(current)
            current = []
        current.append(i)
        current_len = length
    if current:
        batches.append(current)
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=10_000_000)
    parser.add_argument("--reference", default=str(DEFAULT))
    args = parser.parse_args()
    lengths = load_reference(args.reference).reference_lengths(args.tasks)

    # Best of a few runs for each side: the first run of either pays for first-touching memory.
    ours_s = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        plan = plan_batches(lengths, PROFILE)
        ours_s = min(ours_s, time.perf_counter() - start)

    as_list = lengths.tolist()
    python_s = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        batches = python_packer(as_list, PROFILE)
        python_s = min(python_s, time.perf_counter() - start)
    assert sum(len(b) for b in batches) == args.tasks == int(plan.item_count.sum())

    g = PROFILE.seq_granularity
    floor = 1.0 - lengths.sum() / (-(-lengths // g) * g).sum()
    naive_padded = sum(
        max(as_list[i : i + 64]) * len(as_list[i : i + 64]) for i in range(0, len(as_list), 64)
    )
    naive = 1.0 - lengths.sum() / naive_padded
    result = {
        "tasks": args.tasks,
        "plan_seconds": round(ours_s, 3),
        "python_seconds": round(python_s, 3),
        "ratio_vs_python": round(python_s / ours_s, 1),
        "batches": plan.n_batches,
        "shapes": len(plan.shapes()),
        "padding_fraction": round(plan.padding_fraction, 5),
        "padding_floor": round(float(floor), 5),
        "naive_padding_fraction": round(float(naive), 5),
    }
    print(
        f"{args.tasks:,} tasks: planned in {ours_s:.2f} s ({plan.n_batches:,} batches, {result['shapes']} shapes); "
        f"pure-Python packer {python_s:.1f} s: {result['ratio_vs_python']}x"
    )
    print(
        f"padding {plan.padding_fraction:.3%} (floor at granularity {g}: {floor:.3%}); "
        f"naive arrival-order batches of 64: {naive:.3%}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
