"""Read a submitted file (JSONL or Parquet of `id, text` or `id, token_ids`) and tokenise it.

Every record ends as a task or as a failure with a reason a user can act on; a bad record never
aborts the set, whatever it holds (deep nesting, huge numbers, lone surrogates, NUL, wrong types).
Records are numbered from 0 in file order (blank JSONL lines are not records). Only a file that
cannot be read at all raises SubmissionError, before anything is stored.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")
MAX_ID_CHARS = 256
MAX_REASON_CHARS = 1000
TOKENISE_CHUNK = 8192

# Neither PostgreSQL text (NUL) nor UTF-8 (lone surrogates) can hold these.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


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
    where: str = ""  # "line 7" (JSONL) or "row 6" (Parquet): how the user finds the record


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


def storable(text: str, limit: int) -> str:
    """`text` as any database can store it: NUL and lone surrogates written as Python escapes
    (`\\x00`, `\\ud800`), cut to `limit` characters."""
    text = _UNSTORABLE.sub(lambda m: repr(m.group())[1:-1], text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def storable_failure(failure: Failure) -> Failure:
    task_id = None if failure.task_id is None else storable(failure.task_id, MAX_ID_CHARS)
    return Failure(failure.record_no, task_id, storable(failure.reason, MAX_REASON_CHARS))


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
    try:
        for record_no, where, row, parse_error in raw:
            n += 1
            if parse_error is not None:
                failures.append(Failure(record_no, _id_or_none(row), f"{where}: {parse_error}"))
                continue
            record, error = _validate(record_no, where, row)
            if error is not None:
                failures.append(Failure(record_no, _id_or_none(row), f"{where}: {error}"))
                continue
            assert record is not None
            if record.task_id in first_seen:
                failures.append(
                    Failure(
                        record_no,
                        record.task_id,
                        f"{where}: duplicate id {record.task_id!r} (first at record "
                        f"{first_seen[record.task_id]}); ids must be unique within a task set",
                    )
                )
                continue
            first_seen[record.task_id] = record_no
            records.append(record)
    except OSError as exc:
        raise SubmissionError(
            f"{path.name}: cannot be read ({exc.strerror or exc}); check the file and submit it again"
        ) from exc
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
    encoded: dict[int, np.ndarray | str] = {}  # token ids, or why the tokenizer refused the text
    bar = tqdm(total=len(text_idx), desc="tokenise", unit="item", disable=not progress)
    for start in range(0, len(text_idx), TOKENISE_CHUNK):
        chunk = text_idx[start : start + TOKENISE_CHUNK]
        encoded.update(_encode_chunk(tokenizer, [(i, records[i].text or "") for i in chunk]))
        bar.update(len(chunk))
    bar.close()
    for i, record in enumerate(records):
        where = f"{record.where}: " if record.where else ""
        if record.text is not None:
            result = encoded[i]
            if isinstance(result, str):
                failures.append(Failure(record.record_no, record.task_id, where + result))
                continue
            ids = result
        else:
            out_of_vocab = _first_outside(record.token_ids or [], vocab)
            if out_of_vocab is not None:
                pos, value = out_of_vocab
                failures.append(
                    Failure(
                        record.record_no,
                        record.task_id,
                        f"{where}token id {_show_int(value)} at position {pos} of 'token_ids' is "
                        f"outside the vocabulary (0..{vocab - 1}); tokenise with this model's "
                        "tokenizer",
                    )
                )
                continue
            ids = np.asarray(record.token_ids, dtype=np.int32)
        if len(ids) > max_seq_len:
            if not truncate:
                failures.append(
                    Failure(
                        record.record_no,
                        record.task_id,
                        f"{where}over-long: {len(ids)} tokens > max_seq_len {max_seq_len}; split "
                        "the text, raise max_seq_len (up to the model's limit) or submit with "
                        "--truncate",
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
    failures = sorted(
        (storable_failure(f) for f in failures + token_failures), key=lambda f: f.record_no
    )
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


# ---- tokenising ----------------------------------------------------------------------------------


def _encode_chunk(
    tokenizer: Tokenizer, items: list[tuple[int, str]]
) -> Iterator[tuple[int, np.ndarray | str]]:
    """Encode a chunk at once; if the tokenizer refuses it, find the texts it refuses one by one."""
    try:
        batch = tokenizer.encode_batch([text for _, text in items], add_special_tokens=True)
    except Exception:
        for i, text in items:
            try:
                yield i, np.asarray(tokenizer.encode(text, add_special_tokens=True).ids, np.int32)
            except Exception as exc:
                yield i, f"'text' could not be tokenised ({type(exc).__name__}: {exc}); check it"
        return
    for (i, _), enc in zip(items, batch, strict=True):
        yield i, np.asarray(enc.ids, dtype=np.int32)


def _first_outside(token_ids: list[int], vocab: int) -> tuple[int, int] | None:
    """(position, value) of the first token id outside 0..vocab-1, checked before any conversion
    so that ids too large for 64 bits are a reason, not an OverflowError."""
    try:
        ids = np.asarray(token_ids, dtype=np.int64)
    except OverflowError:
        return next((p, t) for p, t in enumerate(token_ids) if not 0 <= t < vocab)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    return (int(bad[0]), int(ids[bad[0]])) if bad.size else None


def _show_int(value: int) -> str:
    # str() of a very long integer is slow, and refused past sys.get_int_max_str_digits().
    return str(value) if value.bit_length() <= 128 else f"of {value.bit_length()} bits"


# ---- parsing -------------------------------------------------------------------------------------

# (record number, where the user finds it, parsed row, why it could not be parsed)
Row = tuple[int, str, object, str | None]


def _jsonl_rows(path: Path) -> Iterator[Row]:
    record_no = 0
    with open(path, "rb") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"line {line_no}"
            row, error = _parse_json_line(line, first=line_no == 1)
            yield record_no, where, row, error
            record_no += 1


def _parse_json_line(line: bytes, *, first: bool) -> tuple[object, str | None]:
    try:
        text = line.decode("utf-8-sig" if first else "utf-8")  # a leading BOM is not content
    except UnicodeDecodeError as exc:
        return None, f"not valid UTF-8 (byte {exc.start}); re-encode the file as UTF-8"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return None, "JSON nested too deeply to read; a record is a flat object of id and text"
    except ValueError as exc:  # an integer beyond Python's digit limit
        limit = sys.get_int_max_str_digits()
        if "digits" in str(exc):
            return None, f"holds a number of more than {limit} digits; write long ids as strings"
        return None, f"not valid JSON: {exc}"


def _parquet_rows(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        columns = set(parquet.schema_arrow.names)
    except Exception as exc:
        raise SubmissionError(f"{path.name}: not a readable Parquet file: {exc}") from exc
    if "id" not in columns or not ({"text", "token_ids"} & columns):
        raise SubmissionError(
            f"{path.name}: Parquet needs an 'id' column and a 'text' or 'token_ids' column; "
            f"found {sorted(columns)}"
        )
    wanted = [c for c in ("id", "text", "token_ids") if c in columns]
    record_no = 0
    batches = parquet.iter_batches(columns=wanted, batch_size=65536)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as exc:  # a damaged page, or a column type Arrow cannot read
            raise SubmissionError(
                f"{path.name}: Parquet data cannot be read from row {record_no} on: {exc}; "
                "write the file again with columns id (string or integer) and text (string) or "
                "token_ids (list of integers)"
            ) from exc
        try:
            rows = batch.to_pylist()
        except Exception:
            rows = None  # some value cannot become a Python one: find which, row by row
        for i in range(batch.num_rows):
            row, error = (rows[i], None) if rows is not None else _parquet_row(batch, i)
            # Nulls in Parquet mean "not given", as an absent key would in JSON.
            row = {k: v for k, v in row.items() if v is not None}
            yield record_no, f"row {record_no}", row, error
            record_no += 1


def _parquet_row(batch: Any, i: int) -> tuple[dict[str, object], str | None]:
    row: dict[str, object] = {}
    for name in batch.schema.names:
        column = batch.column(name)
        try:
            row[name] = column[i].as_py()
        except Exception as exc:
            return row, f"column {name!r} ({column.type}) holds a value that cannot be read: {exc}"
    return row, None


def _id_or_none(row: object) -> str | None:
    """The record's id as far as it can be shown (cut and escaped later), or None."""
    if isinstance(row, dict):
        value = row.get("id")
        if isinstance(value, str):
            return value[: MAX_ID_CHARS + 1]
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value) if value.bit_length() <= 4 * MAX_ID_CHARS else None
    return None


def _validate(record_no: int, where: str, row: object) -> tuple[Record | None, str | None]:
    if not isinstance(row, dict):
        return None, f"record is {_kind(row)}, expected an object with 'id' and 'text'"
    if "id" not in row:
        return None, "missing 'id' (absent or null); every record needs a unique id"
    task_id = row["id"]
    if isinstance(task_id, bool) or not isinstance(task_id, str | int):
        return None, f"'id' must be a string or an integer, got {_kind(task_id)}"
    if isinstance(task_id, int):
        if task_id.bit_length() > 4 * MAX_ID_CHARS:  # surely more than MAX_ID_CHARS digits
            return None, f"'id' must be 1..{MAX_ID_CHARS} characters, got an integer of more"
        task_id = str(task_id)
    if not task_id or len(task_id) > MAX_ID_CHARS:
        return None, f"'id' must be 1..{MAX_ID_CHARS} characters, got {len(task_id)}"
    bad = _unstorable(task_id)
    if bad is not None:
        return None, f"'id' {bad}; ids cannot hold NUL or unpaired surrogates: fix the id"
    has_text, has_tokens = "text" in row, "token_ids" in row
    if has_text == has_tokens:
        given = "both are given" if has_text else "neither is given (or it is null)"
        return None, f"give exactly one of 'text' or 'token_ids': {given}"
    if has_text:
        text = row["text"]
        if not isinstance(text, str):
            return None, f"'text' must be a string, got {_kind(text)}"
        if not text:
            return None, "empty text"
        if not text.strip():
            return None, "text is only whitespace"
        bad = _unstorable(text, allow_nul=True)  # the tokenizer reads NUL; text is not stored
        if bad is not None:
            return None, (
                f"'text' {bad}; fix the escape (\\ud800-\\udfff come in pairs, as in JSON's "
                "\\ud83d\\ude00) or re-encode the file as UTF-8"
            )
        return Record(record_no, task_id, text, None, where), None
    token_ids = row["token_ids"]
    if not isinstance(token_ids, list):
        return None, f"'token_ids' must be a list of integers, got {_kind(token_ids)}"
    wrong = next(
        (p for p, t in enumerate(token_ids) if isinstance(t, bool) or not isinstance(t, int)), None
    )
    if wrong is not None:
        return None, (
            f"'token_ids' must be a list of integers; position {wrong} holds "
            f"{_kind(token_ids[wrong])}"
        )
    if not token_ids:
        return None, "empty token_ids"
    return Record(record_no, task_id, None, token_ids, where), None


def _unstorable(text: str, *, allow_nul: bool = False) -> str | None:
    found = (_SURROGATE if allow_nul else _UNSTORABLE).search(text)
    if found is None:
        return None
    char, pos = found.group(), found.start()
    if char == "\x00":
        return f"holds a NUL character (\\x00) at position {pos}"
    return f"holds a lone surrogate U+{ord(char):04X} at position {pos}, which is not Unicode text"


def _kind(value: object) -> str:
    """A value's type in the user's terms: JSON names for JSON values, else the Python name."""
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a fractional number",
        type(None): "null",
    }
    return names.get(type(value), f"a {type(value).__name__} value")
