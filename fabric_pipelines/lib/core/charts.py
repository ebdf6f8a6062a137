"""Small charts as Markdown tables with bars of block characters: the Dagster UI renders
Markdown metadata, and so does every terminal and README, with nothing to install."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

WIDTH = 30  # characters in the longest bar
BLOCKS = " ▏▎▍▌▋▊▉█"  # eighths of a character


def bar(value: float, largest: float, width: int = WIDTH) -> str:
    if largest <= 0 or value <= 0:
        return ""
    eighths = round(8 * width * value / largest)
    return "█" * (eighths // 8) + (BLOCKS[eighths % 8] if eighths % 8 else "")


def bar_table(
    labels: Sequence[str],
    values: Sequence[float],
    header: tuple[str, str],
    fmt: str = "{:,}",
    full: float | None = None,
) -> str:
    """| label | value | bar | for each row; a full bar is `full` (recall: 1.0), else the
    largest value. A zero gets an empty cell (not an empty code span, which shows as ``)."""
    largest = full if full is not None else max((float(v) for v in values), default=0.0)
    rows = [f"| {header[0]} | {header[1]} | |", "|---|---:|---|"]
    for label, value in zip(labels, values, strict=True):
        drawn = bar(float(value), largest)
        rows.append(f"| {label} | {fmt.format(value)} | {f'`{drawn}`' if drawn else ''} |")
    return "\n".join(rows)


def power_of_two_bins(values: np.ndarray, first: int = 8) -> tuple[list[str], list[int]]:
    """Counts per range 1-first, then up to each next power of two (1-8, 9-16, 17-32, ...)."""
    if values.size == 0:
        return [], []
    top = int(np.ceil(np.log2(max(int(values.max()), first))))
    edges = [0] + [2**e for e in range(int(np.log2(first)), top + 1)]
    counts, _ = np.histogram(values, bins=[e + 1 for e in edges])  # [lo + 1, hi + 1)
    labels = [f"{lo + 1}–{hi}" for lo, hi in itertools.pairwise(edges)]
    return labels, [int(c) for c in counts]


def length_histogram(lengths: np.ndarray) -> str:
    """Tasks per length range, in powers of two (1-8, 9-16, 17-32, ...)."""
    if lengths.size == 0:
        return "no tasks"
    return bar_table(*power_of_two_bins(lengths), ("tokens", "tasks"))
