"""Read a submitted file (JSONL or Parquet of `id, text` or `id, token_ids`) and tokenise it.

Every record ends as a task or as a failure with a reason a user can act on; a bad record never
aborts the set, whatever it holds (deep nesting, huge numbers, lone surrogates, NUL, wrong types).
Records are numbered from 0 in file order (blank JSONL lines are not records). Only a file that
cannot be read at all raises SubmissionError, before anything is stored.

Two readers give the same result. A Parquet file of the plain shape (an 'id' column of strings or
integers, a 'text' column of strings, a 'token_ids' column of lists of integers) is checked column
by column with Arrow and NumPy, so that its good records never pass through Python one by one;
the records that fail a check are handed to the record-by-record reader, which words the reason.
Every other file is read record by record.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from fabric_gpu.tokenise import encode_texts
from fabric_pipelines.lib.tasks.windows import LongInputs, Windows, split

if TYPE_CHECKING:
    import pyarrow as pa

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")
MAX_ID_CHARS = 256
MAX_REASON_CHARS = 1000
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
    # Chunked documents (tasks/windows.py): their windows are the tasks from WINDOW_BASE up.
    windows: Windows | None = None

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def n_chunked(self) -> int:
        return 0 if self.windows is None else len(self.windows.doc_record_no)

    def documents(self) -> tuple[np.ndarray, list[str]]:
        """(record numbers, ids) of every record that became tasks, ascending: a chunked
        document once (its windows carry its id), not once per window."""
        if self.windows is None:
            return self.record_no, self.task_ids
        n_plain = len(self.record_no) - len(self.windows.document)
        record_no = np.concatenate([self.record_no[:n_plain], self.windows.doc_record_no])
        first = self.windows.first_window + n_plain
        ids = self.task_ids[:n_plain] + [self.task_ids[i] for i in first.tolist()]
        order = np.argsort(record_no, kind="stable")
        return record_no[order], [ids[i] for i in order.tolist()]


def storable(text: str, limit: int) -> str:
    """`text` as any database can store it: NUL and lone surrogates written as Python escapes
    (`\\x00`, `\\ud800`), cut to `limit` characters."""
    text = _UNSTORABLE.sub(lambda m: repr(m.group())[1:-1], text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def storable_failure(failure: Failure) -> Failure:
    task_id = None if failure.task_id is None else storable(failure.task_id, MAX_ID_CHARS)
    return Failure(failure.record_no, task_id, storable(failure.reason, MAX_REASON_CHARS))


def ingest(
    path: Path,
    tokenizer: Tokenizer,
    *,
    max_seq_len: int,
    truncate: bool = False,
    long_inputs: LongInputs | None = None,
    progress: bool = False,
    columns: pa.Table | None = None,
) -> TokenisedTasks:
    """Every record of `path` as a task or a failure. Over-long ones follow `long_inputs`
    (tasks/windows.py); without it they fail, or are truncated if `truncate`.

    `columns`: what `plain_parquet` gave for the bytes of `path`, when the caller read them
    already (else the file is read here)."""
    policy = _policy(truncate, long_inputs, max_seq_len)
    table = columns
    if table is None and path.suffix.lower() == ".parquet":
        table = plain_parquet(path)
    if table is None:
        return ingest_record_by_record(
            path, tokenizer, max_seq_len=max_seq_len, long_inputs=policy, progress=progress
        )
    _check_max_seq_len(max_seq_len)
    return _ingest_columns(table, tokenizer, max_seq_len, policy, progress)


def _policy(truncate: bool, long_inputs: LongInputs | None, max_seq_len: int) -> LongInputs:
    policy = long_inputs or LongInputs("truncate" if truncate else "fail")
    policy.check(max_seq_len)
    return policy


def ingest_record_by_record(
    path: Path,
    tokenizer: Tokenizer,
    *,
    max_seq_len: int,
    truncate: bool = False,
    long_inputs: LongInputs | None = None,
    progress: bool = False,
) -> TokenisedTasks:
    """`ingest`, one record at a time, for any file: what the column-wise reader must agree with."""
    _check_max_seq_len(max_seq_len)
    policy = _policy(truncate, long_inputs, max_seq_len)
    n, records, failures = read_records(path)
    tokens, token_failures = tokenise(records, tokenizer, progress=progress)
    where = {r.record_no: r.where for r in records}
    return _within_length(
        n, tokens, failures + token_failures, where.__getitem__, max_seq_len, policy
    )


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
    first_seen: dict[str, str] = {}  # id -> where its first record is
    n = 0
    try:
        for record_no, where, row, parse_error in raw:
            n += 1
            checked = _check_row(record_no, where, row, parse_error)
            if isinstance(checked, Failure):
                failures.append(checked)
                continue
            if checked.task_id in first_seen:
                failures.append(_duplicate(checked, first_seen[checked.task_id]))
                continue
            first_seen[checked.task_id] = where
            records.append(checked)
    except OSError as exc:
        raise SubmissionError(
            f"{path.name}: cannot be read ({exc.strerror or exc}); check the file and submit it again"
        ) from exc
    return n, records, failures


def _check_row(
    record_no: int, where: str, row: object, parse_error: str | None
) -> Record | Failure:
    if parse_error is not None:
        return Failure(record_no, _id_or_none(row), f"{where}: {parse_error}")
    record, error = _validate(record_no, where, row)
    if error is not None:
        return Failure(record_no, _id_or_none(row), f"{where}: {error}")
    assert record is not None
    return record


def _duplicate(record: Record, first_where: str) -> Failure:
    """`first_where` is how the user finds the first record with the id ("line 3", "row 2")."""
    return Failure(
        record.record_no,
        record.task_id,
        f"{record.where}: duplicate id {record.task_id!r} (first at {first_where}); ids must be "
        "unique within a task set",
    )


def _check_max_seq_len(max_seq_len: int) -> None:
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be at least 1, got {max_seq_len}")


# ---- tokens of many records at once --------------------------------------------------------------


@dataclass
class RecordTokens:
    """Some records' ids and tokens back to back, in record order; lengths not yet limited."""

    record_no: np.ndarray  # int64 [records]
    task_ids: list[str]
    offsets: np.ndarray  # int64 [records + 1], from 0
    tokens: np.ndarray  # int32

    @staticmethod
    def of(records: list[Record], arrays: list[np.ndarray]) -> RecordTokens:
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
        return RecordTokens(
            np.fromiter((r.record_no for r in records), dtype=np.int64, count=len(records)),
            [r.task_id for r in records],
            _offsets(lengths),
            tokens.astype(np.int32, copy=False),
        )


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def tokenise(
    records: list[Record], tokenizer: Tokenizer, *, progress: bool = False
) -> tuple[RecordTokens, list[Failure]]:
    """Token ids of every record (special tokens added to text), and the records that have none:
    text the tokenizer refuses, token ids outside the vocabulary. Lengths are not checked here."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = [r.text for r in records if r.text is not None]
    lengths, flat, refused = encode_texts(tokenizer, texts, progress=progress)
    text_offsets = _offsets(lengths)
    kept: list[Record] = []
    arrays: list[np.ndarray] = []
    failures: list[Failure] = []
    text_no = 0
    for record in records:
        where = f"{record.where}: " if record.where else ""
        if record.text is not None:
            i, text_no = text_no, text_no + 1
            if i in refused:
                failures.append(Failure(record.record_no, record.task_id, where + refused[i]))
                continue
            ids = flat[text_offsets[i] : text_offsets[i + 1]]
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
        kept.append(record)
        arrays.append(ids)
    return RecordTokens.of(kept, arrays), failures


def _within_length(
    n_records: int,
    found: RecordTokens,
    failures: list[Failure],
    where: Callable[[int], str],
    max_seq_len: int,
    policy: LongInputs,
) -> TokenisedTasks:
    """The tasks, once over-long records are failed, cut to their head and closing token, or
    split into windows (appended after the other tasks, tasks/windows.py)."""
    lengths = np.diff(found.offsets)
    over = lengths > max_seq_len
    truncate = policy.mode == "truncate"
    keep = ~over if policy.mode != "truncate" else np.ones(len(lengths), dtype=bool)
    failures = list(failures)
    windows = None
    if policy.mode == "chunk" and over.any():
        windows = split(
            found.tokens, found.offsets, np.flatnonzero(over), found.record_no, max_seq_len,
            policy.overlap,
        )  # fmt: skip
    if policy.mode == "fail":
        for i in np.flatnonzero(over).tolist():
            record_no = int(found.record_no[i])
            failures.append(
                Failure(
                    record_no,
                    found.task_ids[i],
                    f"{where(record_no)}: over-long: {int(lengths[i])} tokens > max_seq_len "
                    f"{max_seq_len}; split the text, raise max_seq_len (up to the model's limit) "
                    "or submit with --long-inputs chunk (or truncate)",
                )
            )
    tokens, offsets = _select_rows(found.tokens, found.offsets, keep, max_seq_len)
    kept = found.record_no[keep]
    task_ids = found.task_ids if keep.all() else list(itertools.compress(found.task_ids, keep))
    if windows is not None:
        tokens = np.concatenate([tokens, windows.tokens])
        offsets = np.concatenate([offsets, offsets[-1] + windows.offsets[1:]])
        kept = np.concatenate([kept, windows.record_no])
        over_ids = list(itertools.compress(found.task_ids, over))
        task_ids = task_ids + [over_ids[i] for i in np.repeat(
            np.arange(len(over_ids)), windows.n_windows).tolist()]  # fmt: skip
    return TokenisedTasks(
        n_records=n_records,
        record_no=kept,
        task_ids=task_ids,
        tokens=tokens,
        offsets=offsets,
        failures=sorted(map(storable_failure, failures), key=lambda f: f.record_no),
        truncated=int(np.count_nonzero(over)) if truncate else 0,
        windows=windows,
    )


def _select_rows(
    tokens: np.ndarray, offsets: np.ndarray, keep: np.ndarray, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of the rows in `keep` (offsets from 0), each row longer than `max_len` cut to
    its first `max_len - 1` tokens and its last one (the closing special token)."""
    lengths = np.diff(offsets)
    cut = keep & (lengths > max_len)
    if keep.all() and not cut.any():
        return tokens, offsets
    wanted = np.repeat(keep, lengths)
    if cut.any():
        # Each cut row drops [start + max_len - 1, end - 1): mark both ends, sum to a mask.
        ends = np.zeros(len(tokens) + 1, dtype=np.int8)
        ends[offsets[:-1][cut] + max_len - 1] = 1
        ends[offsets[1:][cut] - 1] = -1
        wanted &= np.cumsum(ends[:-1], dtype=np.int8) == 0
    return tokens[wanted], _offsets(np.minimum(lengths, max_len)[keep])


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


# ---- Parquet of the plain shape, column by column ------------------------------------------------


@functools.cache
def _not_blank() -> str:
    """RE2 (Arrow's engine) for a character str.strip() keeps: a text holding one is not blank."""
    spaces = (c for c in map(chr, range(sys.maxunicode + 1)) if c.isspace())
    return "[^" + "".join(f"\\x{{{ord(c):x}}}" for c in spaces) + "]"


def plain_parquet(source: Path | pa.Buffer) -> pa.Table | None:
    """The id, text and token_ids columns of a Parquet file (a path, or the file's bytes), one
    chunk each, if it is a readable Parquet file of the plain shape with valid UTF-8; else None,
    and the record-by-record reader takes it (and words what is wrong with it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        opened = pa.BufferReader(source) if isinstance(source, pa.Buffer) else source
        with pq.ParquetFile(opened) as parquet:
            schema = parquet.schema_arrow
            wanted = [c for c in ("id", "text", "token_ids") if c in schema.names]
            if not _plain_schema(schema, wanted):
                return None
            table = parquet.read(columns=wanted).combine_chunks()
        for column in table.columns:
            if column.num_chunks > 1:  # over 2 GB of strings: the record reader streams them
                return None
            for chunk in column.chunks:
                chunk.validate(full=True)  # UTF-8 included
    except Exception:
        return None
    return table


def _plain_schema(schema: pa.Schema, wanted: list[str]) -> bool:
    import pyarrow as pa

    if "id" not in wanted or len(wanted) < 2 or len(set(schema.names)) != len(schema.names):
        return False
    strings = (pa.string(), pa.large_string())
    id_type = schema.field("id").type
    if not (pa.types.is_integer(id_type) or id_type in strings):
        return False
    if "text" in wanted and schema.field("text").type not in (*strings, pa.null()):
        return False
    if "token_ids" in wanted:
        lists = schema.field("token_ids").type
        if pa.types.is_list(lists) or pa.types.is_large_list(lists):
            return bool(pa.types.is_integer(lists.value_type))
        return bool(pa.types.is_null(lists))
    return True


@dataclass
class _Lists:
    """A column of integer lists: its values back to back (nulls as 0) and where each row's lie."""

    offsets: np.ndarray  # int64 [rows + 1]
    values: np.ndarray  # the column's integer type
    holds_null: np.ndarray  # bool [rows]

    @staticmethod
    def of(lists: pa.Array) -> _Lists:
        import pyarrow.compute as pc

        offsets = _offsets(_numpy(pc.list_value_length(lists), 0).astype(np.int64))
        values = lists.flatten()  # the values of the non-null lists
        holds_null = np.zeros(len(lists), dtype=bool)
        if values.null_count:
            holds_null = _rows_holding(_numpy(values.is_null(), False), offsets)
        return _Lists(offsets, _numpy(values, 0), holds_null)


def _ingest_columns(
    table: pa.Table, tokenizer: Tokenizer, max_seq_len: int, policy: LongInputs, progress: bool
) -> TokenisedTasks:
    import pyarrow.compute as pc

    n = table.num_rows
    if n == 0:
        return _within_length(0, RecordTokens.of([], []), [], str, max_seq_len, policy)
    task_ids, id_ok = _task_ids(table.column("id").chunk(0))
    text = _column(table, "text")
    lists = _column(table, "token_ids")
    no_rows = np.zeros(n, dtype=bool)
    has_text = no_rows if text is None else _numpy(text.is_valid(), False)
    has_list = no_rows if lists is None else _numpy(lists.is_valid(), False)
    text_ok = id_ok & has_text & ~has_list
    list_ok = id_ok & has_list & ~has_text
    if text is not None and text_ok.any():
        text_ok &= _numpy(pc.match_substring_regex(text, _not_blank()), False)
    flat = _Lists.of(lists) if lists is not None and list_ok.any() else None
    if flat is not None:
        list_ok &= (np.diff(flat.offsets) > 0) & ~flat.holds_null

    # Rows the column checks do not vouch for are read as the record-by-record reader reads them.
    records: list[Record] = []
    failures: list[Failure] = []
    for checked in _check_rows(table, np.flatnonzero(~(text_ok | list_ok))):
        if isinstance(checked, Failure):
            failures.append(checked)
        else:
            records.append(checked)
    valid = text_ok | list_ok
    valid[[r.record_no for r in records]] = True
    repeated = _fail_repeated(task_ids, valid, failures)
    records = [r for r in records if not repeated[r.record_no]]

    parts = []
    if (list_ok & ~repeated).any():
        assert flat is not None
        part, outside = _given_tokens(flat, list_ok & ~repeated, task_ids, tokenizer)
        parts.append(part)
        # The reason names the first such id and its position: the record reader's words.
        records += [r for r in _check_rows(table, outside) if isinstance(r, Record)]
    if (text_ok & ~repeated).any():
        assert text is not None
        parts.append(
            _encode_rows(text, text_ok & ~repeated, task_ids, tokenizer, failures, progress)
        )
    if records:
        records.sort(key=lambda r: r.record_no)
        found, token_failures = tokenise(records, tokenizer, progress=progress)
        parts.append(found)
        failures += token_failures
    return _within_length(n, _merge(parts), failures, lambda no: f"row {no}", max_seq_len, policy)


def _fail_repeated(task_ids: pa.Array, valid: np.ndarray, failures: list[Failure]) -> np.ndarray:
    """Which valid rows repeat the id of an earlier valid row; each joins `failures`."""
    rows = np.flatnonzero(valid)
    encoded = _chosen_array(task_ids, valid).dictionary_encode()
    if len(encoded.dictionary) == len(rows):  # every id once: the usual case, no sort needed
        return np.zeros(len(valid), dtype=bool)
    codes = encoded.indices.to_numpy()
    _, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    first_of = first[inverse]  # per valid row, the first valid row with its id
    repeat = first_of != np.arange(len(rows))
    for row, first_row in zip(rows[repeat].tolist(), rows[first_of[repeat]].tolist(), strict=True):
        task_id = task_ids[row].as_py()
        failures.append(
            _duplicate(Record(row, task_id, None, None, f"row {row}"), f"row {first_row}")
        )
    repeated = np.zeros(len(valid), dtype=bool)
    repeated[rows[repeat]] = True
    return repeated


def _given_tokens(
    flat: _Lists, rows: np.ndarray, task_ids: pa.Array, tokenizer: Tokenizer
) -> tuple[RecordTokens, np.ndarray]:
    """The token ids of `rows` (a mask) that lie in the vocabulary, and the rows (numbers) that
    hold one outside it."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    outside = np.zeros(0, dtype=np.int64)
    if flat.values.min() < 0 or flat.values.max() >= vocab:
        flags = (flat.values < 0) | (flat.values >= vocab)
        outside = np.flatnonzero(_rows_holding(flags, flat.offsets) & rows)
        rows = rows.copy()
        rows[outside] = False
    # In the vocabulary, every id fits in int32.
    values = flat.values.astype(np.int32, copy=False)
    tokens, offsets = _select_rows(values, flat.offsets, rows, sys.maxsize)
    return RecordTokens(np.flatnonzero(rows), _chosen(task_ids, rows), offsets, tokens), outside


def _column(table: pa.Table, name: str) -> pa.Array | None:
    import pyarrow as pa

    if name not in table.column_names or pa.types.is_null(table.schema.field(name).type):
        return None
    return table.column(name).chunk(0)


def _task_ids(ids: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Each row's id as the task id it becomes (an integer in decimal), and whether that is a
    good one: given, 1..MAX_ID_CHARS characters, no NUL."""
    import pyarrow as pa
    import pyarrow.compute as pc

    task_ids = ids.cast(pa.string())
    if pa.types.is_integer(ids.type):
        return task_ids, _numpy(ids.is_valid(), False)
    length = pc.utf8_length(task_ids)
    ok = pc.and_(pc.greater_equal(length, 1), pc.less_equal(length, MAX_ID_CHARS))
    ok = pc.and_(ok, pc.invert(pc.match_substring(task_ids, "\x00")))
    return task_ids, _numpy(ok, False)


def _check_rows(table: pa.Table, rows: np.ndarray) -> Iterator[Record | Failure]:
    """`rows` of the table, as the record-by-record reader checks them."""
    for record_no, row in zip(rows.tolist(), table.take(rows).to_pylist(), strict=True):
        # Nulls in Parquet mean "not given", as an absent key would in JSON.
        given = {k: v for k, v in row.items() if v is not None}
        yield _check_row(record_no, f"row {record_no}", given, None)


def _encode_rows(
    text: pa.Array,
    rows: np.ndarray,
    task_ids: pa.Array,
    tokenizer: Tokenizer,
    failures: list[Failure],
    progress: bool,
) -> RecordTokens:
    """The tokens of the texts of `rows` (a mask); texts the tokenizer refuses join `failures`."""
    texts = _chosen_array(text, rows)
    lengths, flat, refused = encode_texts(tokenizer, texts, progress=progress)
    record_no = np.flatnonzero(rows)
    ids = _chosen(task_ids, rows)
    keep = np.ones(len(record_no), dtype=bool)
    for i, reason in refused.items():
        failures.append(Failure(int(record_no[i]), ids[i], f"row {record_no[i]}: {reason}"))
        keep[i] = False
    tokens, offsets = _select_rows(flat, _offsets(lengths), keep, sys.maxsize)
    return RecordTokens(record_no[keep], list(itertools.compress(ids, keep)), offsets, tokens)


def _merge(parts: list[RecordTokens]) -> RecordTokens:
    """Parts holding different records, as one in record order."""
    import pyarrow as pa

    parts = [p for p in parts if len(p.record_no)]
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return RecordTokens.of([], [])
    record_no = np.concatenate([p.record_no for p in parts])
    order = np.argsort(record_no, kind="stable")
    lists = pa.concat_arrays(
        [pa.LargeListArray.from_arrays(pa.array(p.offsets), pa.array(p.tokens)) for p in parts]
    ).take(pa.array(order))
    task_ids = [t for p in parts for t in p.task_ids]
    return RecordTokens(
        record_no[order],
        [task_ids[i] for i in order.tolist()],
        lists.offsets.to_numpy().astype(np.int64),
        lists.flatten().to_numpy().astype(np.int32, copy=False),
    )


def _rows_holding(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per row, whether any of its values is flagged (values back to back, as `offsets` say)."""
    rows = np.zeros(len(offsets) - 1, dtype=bool)
    rows[np.searchsorted(offsets, np.flatnonzero(flags), side="right") - 1] = True
    return rows


def _chosen_array(values: pa.Array, rows: np.ndarray) -> pa.Array:
    import pyarrow as pa

    return values if rows.all() else values.filter(pa.array(rows))


def _chosen(task_ids: pa.Array, rows: np.ndarray) -> list[str]:
    return list(_chosen_array(task_ids, rows).to_pylist())


def _numpy(values: pa.Array, null: Any) -> np.ndarray:
    """An Arrow array as NumPy, nulls read as `null`."""
    import pyarrow.compute as pc

    if values.null_count:
        values = pc.fill_null(values, null)
    return np.asarray(values.to_numpy(zero_copy_only=False))


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
