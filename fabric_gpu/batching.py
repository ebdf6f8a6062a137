"""Shape-pure batches for one consumer profile, vectorised (no per-item Python loop): how the
pipeline plans a task set and how `fabric_gpu.encode` batches its inputs.

Padded engines: items are grouped by padded length (their length rounded up to the profile's
granularity). Each bucket is cut into as few batches as the profile allows, and the items are
spread evenly over them, so a bucket never ends in a tiny straggler batch. Every batch holds
items of one padded length only (one shape), within all four limits.

Packed engines: items go in arrival order into batches of at most max_batch_tokens tokens and
max_batch_items items; a batch's shape is its token count rounded up to PACKED_GRANULARITY, so
the only padding is that rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fabric_gpu.profile import PACKED_GRANULARITY, ConsumerProfile

PLANNER_VERSION = "bucket-even-2"


@dataclass(frozen=True)
class BatchPlan:
    order: np.ndarray  # int64: task rows (into the task set) in plan order
    seq_len: np.ndarray  # int64 [batches]: the shape: padded length, or packed token capacity
    item_start: np.ndarray  # int64 [batches]: first position in `order`
    item_count: np.ndarray  # int64 [batches]
    real_tokens: np.ndarray  # int64 [batches]
    padded_tokens: np.ndarray  # int64 [batches]: tokens the engine computes, padding included

    @property
    def n_batches(self) -> int:
        return int(self.seq_len.size)

    @property
    def padding_fraction(self) -> float:
        padded = int(self.padded_tokens.sum())
        return 0.0 if padded == 0 else 1.0 - int(self.real_tokens.sum()) / padded

    def shapes(self) -> list[tuple[int, int]]:
        """Distinct (items, seq_len) shapes in the plan."""
        pairs = np.unique(np.stack([self.item_count, self.seq_len], axis=1), axis=0)
        return [(int(a), int(b)) for a, b in pairs]


PREFIX_TOKENS = 16  # items whose first 16 tokens agree are planned side by side
PREFIX_BLOCK = 1 << 14  # items per block while their prefix keys are computed


def prefix_keys(
    tokens: np.ndarray,
    offsets: np.ndarray,
    rows: np.ndarray | None = None,
    prefix: int = PREFIX_TOKENS,
) -> np.ndarray:
    """A 64-bit key per item from its first `prefix` tokens (shorter items: their tokens, then an
    end mark): equal prefixes give equal keys, so sorting by key puts them next to each other.

    The key is FNV-style over the values token + 1 (0 past the item's end), position by
    position. It is computed for a block of items at a time, one position at a time over the
    block: the block's tokens stay in the CPU cache, and no [items, prefix] array is built."""
    offsets = np.asarray(offsets, dtype=np.int64)
    rows = np.arange(offsets.size - 1) if rows is None else np.asarray(rows, dtype=np.int64)
    key = np.zeros(rows.size, dtype=np.uint64)
    block = max(min(rows.size, PREFIX_BLOCK), 1)
    token = np.empty(block, dtype=tokens.dtype)
    value = np.empty(block, dtype=np.uint64)
    past_end = np.empty(block, dtype=bool)
    prime = np.uint64(0x100000001B3)
    with np.errstate(over="ignore"):  # wrapping arithmetic is the point of a hash
        for first in range(0, rows.size, block):
            chunk = rows[first : first + block]
            n = chunk.size
            at = offsets[chunk]  # where each item's j-th token is, j = 0, 1, ...
            lengths = offsets[chunk + 1] - at
            shortest = int(lengths.min()) if n else 0
            out = key[first : first + n]
            for j in range(prefix):
                # Past its end an item reads another token (clipped into the array): masked.
                np.take(tokens, at, mode="clip", out=token[:n])
                value[:n] = token[:n]  # as int64 then uint64: negative ids wrap alike
                value[:n] += np.uint64(1)
                if j >= shortest:
                    np.less_equal(lengths, j, out=past_end[:n])
                    np.putmask(value[:n], past_end[:n], 0)
                out *= prime
                out += value[:n]
                at += 1
    return key


def plan_batches(
    lengths: np.ndarray,
    profile: ConsumerProfile,
    rows: np.ndarray | None = None,
    keys: np.ndarray | None = None,
) -> BatchPlan:
    """Batches over `rows` (default all) of a task set whose items have `lengths` tokens.

    Every length must be in 1..max_seq_len (ingest fails the rest back before planning).
    `keys` (per task row, e.g. prefix_keys()) order the items inside each bucket of a padded
    plan, so items sharing a prefix run together (the engine's cache sees them back to back).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    item_lengths = lengths if rows is None else lengths[rows]
    if item_lengths.size and (item_lengths.min() < 1 or item_lengths.max() > profile.max_seq_len):
        raise ValueError(
            f"item lengths must be within 1..{profile.max_seq_len}; got "
            f"{int(item_lengths.min())}..{int(item_lengths.max())}"
        )
    if profile.layout == "packed":
        all_rows = (
            np.arange(lengths.size, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
        )
        return _plan_packed(lengths, all_rows, profile)
    g = profile.seq_granularity
    # Bucket numbers are small integers (8 bits for up to 255 buckets), so NumPy's stable sort is
    # a one-pass radix sort: O(n), no comparisons.
    buckets = profile.max_seq_len // g
    short = item_lengths.astype(np.uint16)
    bucket = ((short + (g - 1)) // g).astype(np.uint8 if buckets < 256 else np.uint16)
    if keys is None:
        by_length = np.argsort(bucket, kind="stable")
    else:
        key_of_item = np.asarray(keys) if rows is None else np.asarray(keys)[rows]
        by_length = np.lexsort((key_of_item, bucket))
    sorted_lengths = short[by_length]
    order = (
        by_length.astype(np.int64, copy=False)
        if rows is None
        else np.asarray(rows, np.int64)[by_length]
    )
    counts = np.bincount(bucket, minlength=buckets + 1)[1:]
    present = np.flatnonzero(counts)
    bucket_len = (present.astype(np.int64) + 1) * g
    bucket_size = counts[present].astype(np.int64)
    bucket_first = np.cumsum(bucket_size) - bucket_size
    capacity = np.minimum(profile.max_batch_items, profile.max_batch_tokens // bucket_len)
    n_per_bucket = -(-bucket_size // capacity)
    # Spread each bucket evenly over its batches: the first (size mod n) batches get one item
    # more than the rest, so sizes differ by at most one item.
    bucket_of_batch = np.repeat(np.arange(bucket_len.size), n_per_bucket)
    first_batch = np.cumsum(n_per_bucket) - n_per_bucket
    local = np.arange(bucket_of_batch.size) - first_batch[bucket_of_batch]
    base = (bucket_size // n_per_bucket)[bucket_of_batch]
    extra = (bucket_size % n_per_bucket)[bucket_of_batch]
    item_start = bucket_first[bucket_of_batch] + local * base + np.minimum(local, extra)
    item_count = (base + (local < extra)).astype(np.int64)
    real_tokens = (
        np.add.reduceat(sorted_lengths, item_start, dtype=np.int64)
        if item_start.size
        else np.zeros(0, np.int64)
    )
    seq_len = bucket_len[bucket_of_batch].astype(np.int64)
    return BatchPlan(
        order=order,
        seq_len=seq_len,
        item_start=item_start.astype(np.int64),
        item_count=item_count,
        real_tokens=real_tokens,
        padded_tokens=seq_len * item_count,
    )


def _plan_packed(lengths: np.ndarray, rows: np.ndarray, profile: ConsumerProfile) -> BatchPlan:
    """Arrival order, greedy: each batch takes items until the next would pass max_batch_tokens
    or max_batch_items. One binary search per batch, no per-item loop."""
    item_lengths = lengths[rows]
    ends = np.cumsum(item_lengths)
    starts: list[int] = []
    at, n = 0, rows.size
    while at < n:
        before = int(ends[at - 1]) if at else 0
        stop = int(np.searchsorted(ends, before + profile.max_batch_tokens, side="right"))
        starts.append(at)
        at = min(stop, at + profile.max_batch_items)
    item_start = np.asarray(starts, dtype=np.int64)
    item_count = np.diff(np.append(item_start, n)).astype(np.int64)
    real = (
        np.add.reduceat(item_lengths, item_start).astype(np.int64)
        if item_start.size
        else np.zeros(0, np.int64)
    )
    capacity = np.maximum(-(-real // PACKED_GRANULARITY) * PACKED_GRANULARITY, PACKED_GRANULARITY)
    return BatchPlan(
        order=rows.copy(),
        seq_len=capacity,
        item_start=item_start,
        item_count=item_count,
        real_tokens=real,
        padded_tokens=capacity.copy(),
    )
