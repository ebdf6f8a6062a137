"""The column-wise Parquet reader and the batched tokeniser agree with the record-by-record reader.

`ingest` checks a Parquet file of the plain shape column by column and hands only the rows that
fail a check to the record reader. Whatever the mix of good and bad rows, its tasks, tokens and
failures (reasons word for word) must be those of `ingest_record_by_record`; the tokens must also
be those of encoding each text on its own (or the ids given), cut as truncation says.
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

from fabric_gpu import tokenise as tokenise_module
from fabric_gpu.model import DEFAULT_MODEL_ID, load_tokenizer, resolve_model_dir
from fabric_gpu.tokenise import encode_texts
from fabric_pipelines.lib.store.models import Task, TaskSet
from fabric_pipelines.lib.tasks import ingest as ingest_module
from fabric_pipelines.lib.tasks.catalog import attach_task_ids, write_task_ids
from fabric_pipelines.lib.tasks.ingest import (
    TokenisedTasks,
    ingest,
    ingest_record_by_record,
)
from fabric_pipelines.lib.tasks.windows import LongInputs

VOCAB = 30522
EXAMPLES = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(resolve_model_dir(DEFAULT_MODEL_ID))


def assert_same(fast: TokenisedTasks, slow: TokenisedTasks) -> None:
    assert fast.n_records == slow.n_records
    assert fast.record_no.dtype == slow.record_no.dtype == np.int64
    assert fast.record_no.tolist() == slow.record_no.tolist()
    assert fast.task_ids == slow.task_ids
    assert fast.offsets.dtype == slow.offsets.dtype == np.int64
    assert fast.offsets.tolist() == slow.offsets.tolist()
    assert fast.tokens.dtype == slow.tokens.dtype == np.int32
    assert np.array_equal(fast.tokens, slow.tokens)
    assert fast.failures == slow.failures
    assert fast.truncated == slow.truncated
    assert fast.n_chunked == slow.n_chunked


def assert_tokens_as_encoded_one_by_one(
    tasks: TokenisedTasks, table: pa.Table, tokenizer: Any, max_seq_len: int
) -> None:
    """Each task's tokens are its given ids or its text encoded alone, cut to head + last."""
    rows = table.to_pylist()
    for i, record_no in enumerate(tasks.record_no.tolist()):
        row = rows[record_no]
        ids = row.get("token_ids")
        if ids is None:
            ids = tokenizer.encode(row["text"], add_special_tokens=True).ids
        if len(ids) > max_seq_len:
            ids = ids[: max_seq_len - 1] + ids[-1:]
        assert tasks.tokens[tasks.offsets[i] : tasks.offsets[i + 1]].tolist() == ids
        assert tasks.task_ids[i] == str(row["id"])
    assert tasks.record_no.tolist() == sorted(set(tasks.record_no.tolist()))
    assert len(tasks.task_ids) + len(tasks.failures) == tasks.n_records
    assert not set(tasks.record_no.tolist()) & {f.record_no for f in tasks.failures}


def both_ways(path: Path, tokenizer: Any, **kwargs: Any) -> TokenisedTasks:
    """`ingest` of a plain Parquet file, after checking that it took the column-wise reader and
    that the record reader agrees."""
    assert ingest_module.plain_parquet(path) is not None, "the column-wise reader declined"
    fast = ingest(path, tokenizer, **kwargs)
    assert_same(fast, ingest_record_by_record(path, tokenizer, **kwargs))
    return fast


# ---- generated tables: every kind of bad row among good ones -------------------------------------

STRING_IDS = st.one_of(
    st.none(),
    st.sampled_from(["", "x" * 256, "x" * 257, "nul\x00id", "dup", "dup", "é😀", " ", "7"]),
    st.text(min_size=1, max_size=6),
)
INT_IDS = st.one_of(st.none(), st.integers(-3, 12), st.just(2**63 - 1))
TEXTS = st.one_of(
    st.none(),
    st.sampled_from(
        ["", "   ", "\u3000\x1c\u2028\t", "\x00", "a\x00b", "word " * 40, "\ufeffbom", "ok."]
    ),
    st.text(max_size=30),  # never a lone surrogate: Arrow strings are UTF-8
)
TOKEN = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-1, VOCAB, 2**40]))
TOKEN_LISTS = st.one_of(
    st.none(),
    st.just([]),
    st.lists(st.one_of(st.none(), TOKEN), max_size=4),  # nulls inside, out of vocabulary
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
)
LIST_TYPES = [
    pa.list_(pa.int64()),
    pa.large_list(pa.int64()),
    pa.list_(pa.int32()),
    pa.list_(pa.uint64()),
    pa.list_(pa.int16()),
]


def _fits(values: list[Any] | None, value_type: pa.DataType) -> list[Any] | None:
    """`values` squeezed into the range of `value_type` (an out-of-range id stays out of the
    vocabulary where the type allows, else becomes the nearest bound)."""
    if values is None:
        return None
    info = np.iinfo(value_type.to_pandas_dtype())
    return [None if v is None else min(max(v, int(info.min)), int(info.max)) for v in values]


@st.composite
def plain_tables(draw: st.DrawFn) -> pa.Table:
    n = draw(st.integers(0, 24))
    columns: dict[str, pa.Array] = {}
    if draw(st.booleans()):
        id_type = draw(st.sampled_from([pa.string(), pa.large_string()]))
        columns["id"] = pa.array(draw(st.lists(STRING_IDS, min_size=n, max_size=n)), id_type)
    else:
        columns["id"] = pa.array(draw(st.lists(INT_IDS, min_size=n, max_size=n)), pa.int64())
    shape = draw(st.sampled_from(["text", "token_ids", "both", "token_ids, null text"]))
    if shape in ("text", "both"):
        text_type = draw(st.sampled_from([pa.string(), pa.large_string()]))
        columns["text"] = pa.array(draw(st.lists(TEXTS, min_size=n, max_size=n)), text_type)
    if shape == "token_ids, null text":
        columns["text"] = pa.nulls(n, draw(st.sampled_from([pa.string(), pa.null()])))
    if shape != "text":
        list_type = draw(st.sampled_from(LIST_TYPES))
        lists = [_fits(v, list_type.value_type) for v in draw(st.lists(TOKEN_LISTS, min_size=n, max_size=n))]  # fmt: skip
        columns["token_ids"] = pa.array(lists, list_type)
    return pa.table(columns)


@EXAMPLES
@given(
    table=plain_tables(),
    max_seq_len=st.sampled_from([1, 4, 16, 64]),
    mode=st.sampled_from(["fail", "truncate", "chunk"]),
)
def test_column_reader_agrees_with_record_reader(  # type: ignore[no-untyped-def]
    tmp_path: Path, tokenizer, table: pa.Table, max_seq_len: int, mode: str
) -> None:
    path = tmp_path / "set.parquet"
    pq.write_table(table, path)
    if mode == "chunk":  # windows of 3 tokens and up (two specials and what they hold)
        long_inputs = LongInputs("chunk", overlap=max_seq_len // 4)
        if max_seq_len < 3:
            with pytest.raises(ValueError, match="window_overlap"):
                both_ways(path, tokenizer, max_seq_len=max_seq_len, long_inputs=long_inputs)
            return
        tasks = both_ways(path, tokenizer, max_seq_len=max_seq_len, long_inputs=long_inputs)
        assert not any("over-long" in f.reason for f in tasks.failures)
        assert int(tasks.lengths.max(initial=0)) <= max_seq_len
        return
    tasks = both_ways(path, tokenizer, max_seq_len=max_seq_len, truncate=mode == "truncate")
    assert_tokens_as_encoded_one_by_one(tasks, table, tokenizer, max_seq_len)


@pytest.mark.parametrize("kind", ["token_ids", "text"])
def test_many_rows_with_bad_ones_scattered(  # type: ignore[no-untyped-def]
    tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Thousands of rows, one in ten bad in some way, ids repeated at random distances; texts
    in chunks small enough that encoding overlaps collecting many times."""
    monkeypatch.setattr(tokenise_module, "TOKENISE_CHUNK", 97)
    rng = random.Random(kind)
    n = 4000
    ids: list[str | None] = [f"id-{rng.randrange(n * 4)}" for _ in range(n)]
    good_lists = [
        [101] + [rng.randrange(1000, VOCAB) for _ in range(rng.randrange(0, 60))] + [102]
        for _ in range(n)
    ]
    good_texts = [" ".join(rng.choice(["tea", "café", "x1", "dé-jà"]) for _ in range(40)) for _ in range(n)]  # fmt: skip
    lists: list[list[int | None] | None] = list(good_lists) if kind == "token_ids" else [None] * n
    texts: list[str | None] = list(good_texts) if kind == "text" else [None] * n
    for i in rng.sample(range(n), n // 10):
        bad = rng.choice(["no id", "long id", "NUL id", "empty", "blank", "both", "neither", "null in", "outside"])  # fmt: skip
        if bad == "no id":
            ids[i] = None
        elif bad == "long id":
            ids[i] = "y" * 300
        elif bad == "NUL id":
            ids[i] = "a\x00"
        elif bad == "both":
            lists[i], texts[i] = good_lists[i], good_texts[i]
        elif bad == "neither":
            lists[i] = texts[i] = None
        elif kind == "text":
            texts[i] = {"empty": "", "blank": " \u2003\n", "null in": "", "outside": "\t"}[bad]
        else:
            value = {"empty": [], "null in": [101, None, 102], "outside": [101, -7, 102]}
            lists[i] = value.get(bad, [101, VOCAB + 5, 102])
    table = pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "text": pa.array(texts, pa.string()),
            "token_ids": pa.array(lists, pa.list_(pa.int64())),
        }
    )
    path = tmp_path / "many.parquet"
    pq.write_table(table, path, row_group_size=700)
    for max_seq_len, truncate in [(48, False), (48, True), (512, False)]:
        tasks = both_ways(path, tokenizer, max_seq_len=max_seq_len, truncate=truncate)
        assert len(tasks.failures) > n // 10  # the bad rows, repeated ids, and over-long ones
        assert_tokens_as_encoded_one_by_one(tasks, table, tokenizer, max_seq_len)


def test_reasons_name_the_row_and_the_field(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The column-wise reader's reasons, spelt out (the record reader's words)."""
    table = pa.table(
        {
            "id": ["ok", "ok", "", "n\x00", None, "neg", "big", "nul-in", "empty", "long", "k"],
            "token_ids": pa.array(
                [[101, 102], [101, 102], [1], [1], [1], [101, -1], [101, 2**40], [101, None],
                 [], [101] * 9, [101, 7592, 102]],
                pa.list_(pa.int64()),
            ),
        }
    )  # fmt: skip
    path = tmp_path / "reasons.parquet"
    pq.write_table(table, path)
    tasks = both_ways(path, tokenizer, max_seq_len=8)
    assert tasks.task_ids == ["ok", "k"]
    reasons = {f.record_no: f.reason for f in tasks.failures}
    assert reasons == {
        1: "row 1: duplicate id 'ok' (first at row 0); ids must be unique within a task set",
        2: "row 2: 'id' must be 1..256 characters, got 0",
        3: "row 3: 'id' holds a NUL character (\\x00) at position 1; ids cannot hold NUL or "
        "unpaired surrogates: fix the id",
        4: "row 4: missing 'id' (absent or null); every record needs a unique id",
        5: f"row 5: token id -1 at position 1 of 'token_ids' is outside the vocabulary "
        f"(0..{VOCAB - 1}); tokenise with this model's tokenizer",
        6: f"row 6: token id {2**40} at position 1 of 'token_ids' is outside the vocabulary "
        f"(0..{VOCAB - 1}); tokenise with this model's tokenizer",
        7: "row 7: 'token_ids' must be a list of integers; position 1 holds null",
        8: "row 8: empty token_ids",
        9: "row 9: over-long: 9 tokens > max_seq_len 8; split the text, raise max_seq_len (up to "
        "the model's limit) or submit with --long-inputs chunk (or truncate)",
    }
    assert tasks.failures[2].task_id == "n\\x00"  # stored escaped


def test_a_duplicate_of_a_bad_row_is_not_a_duplicate(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Only records that passed their own checks claim an id; ones failed later (outside the
    vocabulary, over-long) still do, as in the record reader."""
    table = pa.table(
        {
            "id": ["a", "a", "b", "b", "c", "c"],
            "token_ids": pa.array(
                [[], [101, 102], [101, -1], [101, 102], [101] * 20, [101, 102]],
                pa.list_(pa.int32()),
            ),
        }
    )
    path = tmp_path / "claims.parquet"
    pq.write_table(table, path)
    tasks = both_ways(path, tokenizer, max_seq_len=8)
    assert tasks.task_ids == ["a"] and tasks.record_no.tolist() == [1]
    reasons = {f.record_no: f.reason for f in tasks.failures}
    assert "duplicate id 'b' (first at row 2)" in reasons[3]
    assert "duplicate id 'c' (first at row 4)" in reasons[5]


def test_good_rows_left_to_the_record_reader_still_count(  # type: ignore[no-untyped-def]
    tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows the column checks pass on to the record reader may turn out good: they claim their
    ids against the rows checked by column, and join the tasks in record order."""
    monkeypatch.setattr(ingest_module, "_not_blank", lambda: "a^")  # vouches for no text
    table = pa.table(
        {
            "id": ["t", "x", "t", "y", "x", "z"],
            "text": ["a text", None, "again", "more text", None, "\u3000"],
            "token_ids": pa.array(
                [None, [101, 102], None, None, [101, 7, 102], None], pa.list_(pa.int64())
            ),
        }
    )
    path = tmp_path / "mixed.parquet"
    pq.write_table(table, path)
    tasks = both_ways(path, tokenizer, max_seq_len=3, truncate=True)
    assert tasks.task_ids == ["t", "x", "y"] and tasks.truncated == 2
    assert [f.reason for f in tasks.failures] == [
        "row 2: duplicate id 't' (first at row 0); ids must be unique within a task set",
        "row 4: duplicate id 'x' (first at row 1); ids must be unique within a task set",
        "row 5: text is only whitespace",
    ]
    assert_tokens_as_encoded_one_by_one(tasks, table, tokenizer, 3)


class RefusingTokenizer:
    """The real tokenizer, except that it refuses every text holding 'refuse'."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def get_vocab_size(self, *, with_added_tokens: bool) -> int:
        return int(self.real.get_vocab_size(with_added_tokens=with_added_tokens))

    def encode_batch_fast(self, texts: list[str], *, add_special_tokens: bool) -> Any:
        if any("refuse" in t for t in texts):
            raise ValueError("will not")
        return self.real.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    def encode(self, text: str, *, add_special_tokens: bool) -> Any:
        if "refuse" in text:
            raise ValueError("will not")
        return self.real.encode(text, add_special_tokens=add_special_tokens)


def test_texts_the_tokenizer_refuses_fail_alone(  # type: ignore[no-untyped-def]
    tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenise_module, "TOKENISE_CHUNK", 3)
    texts = ["one", "two", "refuse me", "four", "five", "six", "seven", "refuse", "nine"]
    table = pa.table({"id": [f"t{i}" for i in range(len(texts))], "text": texts})
    path = tmp_path / "refused.parquet"
    pq.write_table(table, path)
    tasks = both_ways(path, RefusingTokenizer(tokenizer), max_seq_len=16)
    assert tasks.task_ids == ["t0", "t1", "t3", "t4", "t5", "t6", "t8"]
    assert [(f.record_no, f.reason) for f in tasks.failures] == [
        (i, f"row {i}: 'text' could not be tokenised (ValueError: will not); check it")
        for i in (2, 7)
    ]
    assert_tokens_as_encoded_one_by_one(tasks, table, tokenizer, 16)


def test_encode_texts_is_encoding_each_text_alone(  # type: ignore[no-untyped-def]
    tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In chunks small enough that encoding one overlaps flattening the last many times."""
    monkeypatch.setattr(tokenise_module, "TOKENISE_CHUNK", 37)
    rng = random.Random(7)
    alphabet = "ab é😀\u3000\x00-.,'\n字"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 50))) for _ in range(500)]
    for as_given in (texts, pa.array(texts)):
        lengths, tokens, refused = encode_texts(tokenizer, as_given)
        assert not refused and lengths.dtype == np.int64 and tokens.dtype == np.int32
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for i, text in enumerate(texts):
            assert tokens[offsets[i] : offsets[i + 1]].tolist() == tokenizer.encode(text).ids
    empty = encode_texts(tokenizer, [])
    assert empty[0].size == empty[1].size == 0 and not empty[2]


@pytest.mark.parametrize(
    ("columns", "why"),
    [
        ({"id": pa.array([1.5, 2.5]), "text": ["a", "b"]}, "id of floats"),
        ({"id": ["a", "b"], "text": pa.array([b"x", b"y"])}, "text of bytes"),
        ({"id": ["a", "b"], "token_ids": pa.array([[1.0], [2.0]])}, "lists of floats"),
        ({"id": ["a", "b"], "token_ids": pa.array([[True], [False]])}, "lists of booleans"),
        ({"id": ["a", "b"], "token_ids": pa.array([[[1]], [[2]]])}, "lists of lists"),
        ({"id": pa.array(["a", "b"]).dictionary_encode(), "text": ["x", "y"]}, "dictionary ids"),
        ({"id": ["a", "b"], "extra": [1, 2]}, "no text or token_ids"),
    ],
)
def test_other_shapes_are_read_record_by_record(  # type: ignore[no-untyped-def]
    tmp_path: Path, tokenizer, columns: dict[str, Any], why: str
) -> None:
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table(columns), path)
    assert ingest_module.plain_parquet(path) is None, why


def test_invalid_utf8_is_left_to_the_record_reader(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    offsets = np.array([0, 2, 7], dtype=np.int32)
    text = pa.Array.from_buffers(
        pa.string(), 2, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"okbad\xff\xfe")]
    )
    path = tmp_path / "latin.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": text}), path)
    assert ingest_module.plain_parquet(path) is None
    tasks = ingest(path, tokenizer, max_seq_len=16)
    assert tasks.task_ids == ["a"]
    assert tasks.failures[0].reason.startswith("row 1: column 'text' (string) holds a value")


def test_max_seq_len_below_one_is_refused(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "set.parquet"
    pq.write_table(pa.table({"id": ["a"], "token_ids": [[101, 102]]}), path)
    with pytest.raises(ValueError, match="max_seq_len must be at least 1"):
        ingest(path, tokenizer, max_seq_len=0)


# ---- task ids in bulk ----------------------------------------------------------------------------


def test_task_ids_are_written_as_given_on_both_databases(db: Engine) -> None:
    task_ids = ["a", "é😀", 'quote"d', "back\\slash", "comma,", "line\nbreak", "\\.", "x" * 256]
    record_no = np.array([0, 2, 3, 5, 8, 13, 21, 34], dtype=np.int64)
    with db.begin() as conn:
        set_id = conn.execute(
            TaskSet.__table__.insert().returning(TaskSet.id),
            {
                "name": "ids",
                "source_sha256": "0" * 64,
                "content_sha256": "0" * 64,
                "path": "ids.arrow",
                "model_id": "m",
                "tokenizer_sha256": "0" * 64,
                "max_seq_len": 8,
                "n_records": 35,
                "n_tasks": len(task_ids),
                "truncated": 0,
            },
        ).scalar_one()
        raw = conn.connection.driver_connection
        if db.dialect.name == "sqlite":
            assert isinstance(raw, sqlite3.Connection)
            cache_size = raw.execute("PRAGMA cache_size").fetchone()[0]
        write_task_ids(conn, set_id, record_no, task_ids)
        attach_task_ids(conn, set_id)
        if db.dialect.name == "sqlite":  # the bigger page cache was for this insert alone
            assert raw.execute("PRAGMA cache_size").fetchone()[0] == cache_size
    with db.connect() as conn:
        rows = conn.execute(
            select(Task.record_no, Task.task_id)
            .where(Task.task_set_id == set_id)
            .order_by(Task.record_no)
        ).all()
    assert [tuple(r) for r in rows] == list(zip(record_no.tolist(), task_ids, strict=True))
