"""Read a submitted file (JSONL or Parquet of `id, text` or `id, token_ids`) and tokenise it.

Every record ends as a task or as a failure with a reason a user can act on; a bad record never
aborts the set. Records are numbered from 0 in file order (blank JSONL lines are not records).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")
MAX_ID_CHARS = 256
TOKENISE_CHUNK = 8192


class SubmissionError(ValueError):
    """The file as a whole cannot be read (wrong format, unreadable): nothing was ingested."""


@dataclass(frozen=True)
class Failure:
    record_no: int
    task_id: str | None
    reason: str


@dataclass
class Record:
    record_no: int
    task_id: str
    text: str | None
    token_ids: list[int] | None


@dataclass
class TokenisedTasks:
    """Good records in file order, their tokens flat with offsets, and every failure."""

    n_records: int
    record_no: np.ndarray  # int64 [tasks]
    task_ids: list[str]
    tokens: np.ndarray  # int32, all tasks back to back
    offsets: np.ndarray  # int64 [tasks + 1]
    failures: list[Failure] = field(default_factory=list)
    truncated: int = 0

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def read_records(path: Path) -> tuple[int, list[Record], list[Failure]]:
    """Parse and validate every record of `path`: (records seen, good records, failures)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        raw = _jsonl_rows(path)
    elif suffix == ".parquet":
        raw = _parquet_rows(path)
    else:
        raise SubmissionError(
            f"{path.name}: unsupported file type {suffix!r}; submit {' or '.join(SUPPORTED_SUFFIXES)}"
        )
    records: list[Record] = []
    failures: list[Failure] = []
    first_seen: dict[str, int] = {}
    n = 0
    for record_no, row, parse_error in raw:
        n += 1
        if parse_error is not None:
            failures.append(Failure(record_no, None, parse_error))
            continue
        record, error = _validate(record_no, row)
        if error is not None:
            failures.append(Failure(record_no, _id_or_none(row), error))
            continue
        assert record is not None
        if record.task_id in first_seen:
            failures.append(
                Failure(
                    record_no,
                    record.task_id,
                    f"duplicate id {record.task_id!r} (first at record {first_seen[record.task_id]});"
                    " ids must be unique within a task set",
                )
            )
            continue
        first_seen[record.task_id] = record_no
        records.append(record)
    return n, records, failures


def tokenise(
    records: list[Record],
    tokenizer: Tokenizer,
    *,
    max_seq_len: int,
    truncate: bool = False,
    progress: bool = False,
) -> tuple[list[Record], list[np.ndarray], list[Failure], int]:
    """Token ids per record (special tokens added to text); over-long items fail unless truncating."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    kept: list[Record] = []
    arrays: list[np.ndarray] = []
    failures: list[Failure] = []
    truncated = 0
    text_idx = [i for i, r in enumerate(records) if r.text is not None]
    encoded: dict[int, np.ndarray] = {}
    bar = tqdm(total=len(text_idx), desc="tokenise", unit="item", disable=not progress)
    for start in range(0, len(text_idx), TOKENISE_CHUNK):
        chunk = text_idx[start : start + TOKENISE_CHUNK]
        texts = [records[i].text or "" for i in chunk]
        for i, enc in zip(
            chunk, tokenizer.encode_batch(texts, add_special_tokens=True), strict=True
        ):
            encoded[i] = np.asarray(enc.ids, dtype=np.int32)
        bar.update(len(chunk))
    bar.close()
    for i, record in enumerate(records):
        if record.text is not None:
            ids = encoded[i]
        else:
            ids = np.asarray(record.token_ids, dtype=np.int64)
            bad = np.flatnonzero((ids < 0) | (ids >= vocab))
            if bad.size:
                pos = int(bad[0])
                failures.append(
                    Failure(
                        record.record_no,
                        record.task_id,
                        f"token id {int(ids[pos])} at position {pos} is outside the vocabulary "
                        f"(0..{vocab - 1}); tokenise with this model's tokenizer",
                    )
                )
                continue
            ids = ids.astype(np.int32)
        if len(ids) > max_seq_len:
            if not truncate:
                failures.append(
                    Failure(
                        record.record_no,
                        record.task_id,
                        f"over-long: {len(ids)} tokens > max_seq_len {max_seq_len}; split the text, "
                        "raise max_seq_len (up to the model's limit) or submit with truncate",
                    )
                )
                continue
            # Keep the head and the closing special token.
            ids = np.concatenate([ids[: max_seq_len - 1], ids[-1:]])
            truncated += 1
        kept.append(record)
        arrays.append(ids)
    return kept, arrays, failures, truncated


def ingest(
    path: Path,
    tokenizer: Tokenizer,
    *,
    max_seq_len: int,
    truncate: bool = False,
    progress: bool = False,
) -> TokenisedTasks:
    n, records, failures = read_records(path)
    kept, arrays, token_failures, truncated = tokenise(
        records, tokenizer, max_seq_len=max_seq_len, truncate=truncate, progress=progress
    )
    failures = sorted(failures + token_failures, key=lambda f: f.record_no)
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
    return TokenisedTasks(
        n_records=n,
        record_no=np.fromiter((r.record_no for r in kept), dtype=np.int64, count=len(kept)),
        task_ids=[r.task_id for r in kept],
        tokens=tokens.astype(np.int32, copy=False),
        offsets=offsets,
        failures=failures,
        truncated=truncated,
    )


# ---- parsing -------------------------------------------------------------------------------------

Row = tuple[int, object, str | None]


def _jsonl_rows(path: Path) -> Iterator[Row]:
    record_no = 0
    with open(path, "rb") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield (
                    record_no,
                    None,
                    (
                        f"line {line_no} is not valid UTF-8 (byte {exc.start}); re-encode the file as UTF-8"
                    ),
                )
                record_no += 1
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                yield (
                    record_no,
                    None,
                    f"line {line_no} is not valid JSON: {exc.msg} (column {exc.colno})",
                )
                record_no += 1
                continue
            yield record_no, row, None
            record_no += 1


def _parquet_rows(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:
        raise SubmissionError(f"{path.name}: not a readable Parquet file: {exc}") from exc
    columns = set(parquet.schema_arrow.names)
    if "id" not in columns or not ({"text", "token_ids"} & columns):
        raise SubmissionError(
            f"{path.name}: Parquet needs an 'id' column and a 'text' or 'token_ids' column; "
            f"found {sorted(columns)}"
        )
    wanted = [c for c in ("id", "text", "token_ids") if c in columns]
    record_no = 0
    for batch in parquet.iter_batches(columns=wanted, batch_size=65536):
        for row in batch.to_pylist():
            # Nulls in Parquet mean "not given", as an absent key would in JSON.
            yield record_no, {k: v for k, v in row.items() if v is not None}, None
            record_no += 1


def _id_or_none(row: object) -> str | None:
    if isinstance(row, dict):
        value = row.get("id")
        if isinstance(value, str | int) and not isinstance(value, bool):
            return str(value)[:MAX_ID_CHARS]
    return None


def _validate(record_no: int, row: object) -> tuple[Record | None, str | None]:
    if not isinstance(row, dict):
        return (
            None,
            f"record is a JSON {type(row).__name__}, expected an object with 'id' and 'text'",
        )
    if "id" not in row:
        return None, "missing 'id'; every record needs a unique id"
    task_id = row["id"]
    if isinstance(task_id, bool) or not isinstance(task_id, str | int):
        return None, f"'id' must be a string or an integer, got {type(task_id).__name__}"
    task_id = str(task_id)
    if not task_id or len(task_id) > MAX_ID_CHARS:
        return None, f"'id' must be 1..{MAX_ID_CHARS} characters, got {len(task_id)}"
    has_text, has_tokens = "text" in row, "token_ids" in row
    if has_text == has_tokens:
        return None, "give exactly one of 'text' or 'token_ids'"
    if has_text:
        text = row["text"]
        if not isinstance(text, str):
            return None, f"'text' must be a string, got {type(text).__name__}"
        if not text:
            return None, "empty text"
        if not text.strip():
            return None, "text is only whitespace"
        return Record(record_no, task_id, text, None), None
    token_ids = row["token_ids"]
    if not isinstance(token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in token_ids
    ):
        return None, "'token_ids' must be a list of integers"
    if not token_ids:
        return None, "empty token_ids"
    return Record(record_no, task_id, None, token_ids), None
