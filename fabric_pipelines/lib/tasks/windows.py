"""Long inputs: what happens to a record longer than the model's length, and its windows.

Three policies, chosen per task set (`--long-inputs`, the manifest's `long_inputs`):
- `fail`: the record fails at ingest with its reason;
- `truncate`: the record keeps its head and its closing special token, as sentence-transformers'
  `encode()` does (counted as truncated);
- `chunk` (the default): the record is split into windows of the model's length that overlap by
  `overlap` tokens; each window is a task the broker packs like any other, and once all of a
  document's windows are stored its vector is their token-weighted mean (lib/results/documents.py).

A window is `[first token] + a run of the document's inner tokens + [last token]`: the first and
last tokens of a tokenised record are the model's special tokens ([CLS]/[SEP], <s>/</s>), so
every window reads as a text of its own would. Windows get record numbers of their own, from
WINDOW_BASE up, so that a document's own record number holds its combined vector and every
record number below WINDOW_BASE is a document (the index and `fabric export` read those).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

__all__ = ["WINDOW_BASE", "LongInputs", "Windows", "long_input_policy", "split", "weighted_mean"]

import numpy as np

from fabric_pipelines.lib.store.models import WINDOW_BASE

MODES = ("chunk", "truncate", "fail")
DEFAULT_MODE = "chunk"
DEFAULT_OVERLAP = 32

Mode = Literal["chunk", "truncate", "fail"]


@dataclass(frozen=True)
class LongInputs:
    """The policy for records over max_seq_len; `overlap` counts tokens two windows share."""

    mode: Mode = "chunk"
    overlap: int = DEFAULT_OVERLAP

    @staticmethod
    def of(mode: str, overlap: int = DEFAULT_OVERLAP) -> LongInputs:
        if mode not in MODES:
            raise ValueError(f"long_inputs {mode!r}: choose one of {', '.join(MODES)}")
        if not isinstance(overlap, int) or overlap < 0:
            raise ValueError(f"window_overlap {overlap!r}: give a whole number of tokens >= 0")
        return LongInputs(cast(Mode, mode), overlap)

    def check(self, max_seq_len: int) -> None:
        """A window holds max_seq_len - 2 inner tokens; the overlap must leave it room to move."""
        if self.mode == "chunk" and (max_seq_len < 3 or self.overlap >= max_seq_len - 2):
            raise ValueError(
                f"window_overlap {self.overlap} leaves windows of {max_seq_len} tokens no room to "
                f"advance: give an overlap below {max_seq_len - 2} (and a max_seq_len of 3 or more)"
            )

    @property
    def label(self) -> str:
        """As recorded with the task set: `chunk:32`, `truncate`, `fail`."""
        return f"chunk:{self.overlap}" if self.mode == "chunk" else self.mode

    @staticmethod
    def from_label(label: str) -> LongInputs:
        mode, _, overlap = label.partition(":")
        return LongInputs.of(mode, int(overlap) if overlap else DEFAULT_OVERLAP)


def window_starts(n_tokens: int, max_seq_len: int, overlap: int) -> np.ndarray:
    """Where each window of a record of `n_tokens` tokens starts among its inner tokens (the
    record without its first and last token). The last window ends at the last inner token."""
    inner, width = n_tokens - 2, max_seq_len - 2
    if inner <= width:
        return np.zeros(1, dtype=np.int64)
    step = width - overlap
    n_windows = -(-(inner - width) // step) + 1
    starts = np.arange(n_windows, dtype=np.int64) * step
    starts[-1] = inner - width  # the last one flush with the end: never a short tail window
    return starts


def long_input_policy(
    mode: str | None = None, overlap: int | None = None, truncate: bool | None = None
) -> LongInputs:
    """The policy the engine's settings name, with the defaults for what they leave out (one
    place for the step's resource and the CLI's ingest ahead, which must agree):
    `truncate`, the earlier spelling, wins where given (True "truncate", False "fail")."""
    if truncate is not None:
        return LongInputs("truncate" if truncate else "fail")
    return LongInputs.of(
        DEFAULT_MODE if mode is None else mode, DEFAULT_OVERLAP if overlap is None else overlap
    )


@dataclass
class Windows:
    """Every window of the over-long records, in document order, tokens flat with offsets, and
    for each document its first window (counted from WINDOW_BASE), its window count and its own
    token count."""

    tokens: np.ndarray  # int32
    offsets: np.ndarray  # int64 [windows + 1]
    document: np.ndarray  # int64 [windows]: the record number of each window's document
    doc_record_no: np.ndarray  # int64 [documents]
    first_window: np.ndarray  # int64 [documents]
    n_windows: np.ndarray  # int64 [documents]
    doc_tokens: np.ndarray  # int64 [documents]
    overlap: int = 0

    @property
    def record_no(self) -> np.ndarray:
        return WINDOW_BASE + np.arange(len(self.document), dtype=np.int64)


def split(
    tokens: np.ndarray,
    offsets: np.ndarray,
    rows: np.ndarray,
    record_no: np.ndarray,
    max_seq_len: int,
    overlap: int,
) -> Windows:
    """The windows of `rows` (indices into offsets' rows, ascending), whose record numbers are
    `record_no[rows]`."""
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    document: list[np.ndarray] = []
    n_windows = np.zeros(len(rows), dtype=np.int64)
    width = max_seq_len - 2
    for i, row in enumerate(rows.tolist()):
        start, end = int(offsets[row]), int(offsets[row + 1])
        record = tokens[start:end]
        starts = window_starts(end - start, max_seq_len, overlap)
        # All windows of the record at once: one gather of [first, inner run, last] rows.
        take = np.empty((len(starts), width + 2), dtype=np.int64)
        take[:, 0] = 0
        take[:, 1:-1] = 1 + starts[:, None] + np.arange(width)
        take[:, -1] = end - start - 1
        pieces.append(record[take].reshape(-1))
        lengths += [width + 2] * len(starts)
        n_windows[i] = len(starts)
        document.append(np.full(len(starts), record_no[row], dtype=np.int64))
    first = np.concatenate([[0], np.cumsum(n_windows)[:-1]]).astype(np.int64)
    return Windows(
        tokens=np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32),
        offsets=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        document=np.concatenate(document) if document else np.zeros(0, np.int64),
        doc_record_no=np.asarray(record_no[rows], dtype=np.int64),
        first_window=first,
        n_windows=n_windows,
        doc_tokens=(offsets[rows + 1] - offsets[rows]).astype(np.int64),
        overlap=overlap,
    )


def weighted_mean(vectors: np.ndarray, weights: np.ndarray, normalize: bool) -> np.ndarray:
    """A document's vector from its windows': the mean weighted by each window's tokens, in
    float64, then unit length if the model normalises (float32)."""
    w = np.asarray(weights, dtype=np.float64)
    mean = (np.asarray(vectors, dtype=np.float64) * w[:, None]).sum(axis=0) / w.sum()
    if normalize:
        norm = np.linalg.norm(mean)
        if norm > 0:
            mean = mean / norm
    return mean.astype(np.float32)
