"""Every table of the product's database, in one place.

The database is the source of truth for what happened to each task: task sets and their failures,
batch plans and the batch ledger, embeddings, hidden-state shard files and index receipts.

One identity per entity (migration 0010): a task set is `task_sets.id` and a model `models.id`
wherever another table refers to one, through a foreign key; deleting a task set deletes its
failures, plans, ledger rows and shard rows with it. Names are read through the ids
(`task_set` / `model_key` below read as before, but are never stored twice).

The two bulk tables, `tasks` and `embeddings`, carry the same ids without a foreign key: their
rows arrive by the million through COPY, and the per-row check a foreign key costs made inserting
embeddings 1.6-1.8x slower on PostgreSQL (measured, 300 k rows of 3 KB). Their rows are removed
with their task set by `tasks/catalog.forget_task_set` and checked by `fabric verify`.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    ScalarSelect,
    String,
    Text,
    UniqueConstraint,
    column,
    select,
    table,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, column_property, mapped_column

# SQLite only auto-increments a column declared exactly INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    # Foreign keys get names migrations can drop them by (the index names are SQLAlchemy's own).
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(column_0_label)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s",
        }
    )


class TaskSet(Base):
    """One submitted, tokenised task set. Immutable: the same name never holds other content."""

    __tablename__ = "task_sets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    source_sha256: Mapped[str] = mapped_column(String(64))  # the submitted file
    content_sha256: Mapped[str] = mapped_column(String(64))  # the stored Arrow file
    path: Mapped[str] = mapped_column(Text)
    model_id: Mapped[str] = mapped_column(String(256))
    tokenizer_sha256: Mapped[str] = mapped_column(String(64))
    max_seq_len: Mapped[int] = mapped_column(Integer)
    n_records: Mapped[int] = mapped_column(BigInteger)  # every record submitted, good or bad
    n_tasks: Mapped[int] = mapped_column(BigInteger)  # records that became tasks
    truncated: Mapped[int] = mapped_column(BigInteger, default=0)
    # Prepended to every text before tokenising (migration 0008); "" for none.
    prompt: Mapped[str] = mapped_column(Text, default="", server_default="")
    # How over-long records were taken (tasks/windows.py); NULL: stored before 0011 (truncated
    # > 0 says truncate, else fail).
    long_inputs: Mapped[str | None] = mapped_column(String(32), nullable=True)
    n_chunked: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    n_windows: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    current_plan_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Task(Base):
    """The id of every task that became a task (records that failed at ingest are not here).
    PostgreSQL: one partition per task set (store/task_partitions.py)."""

    __tablename__ = "tasks"
    __table_args__ = (
        UniqueConstraint("task_set_id", "task_id", name="uq_tasks_id"),
        {"postgresql_partition_by": "LIST (task_set_id)"},
    )

    task_set_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    record_no: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    # PostgreSQL compares ids byte by byte: same equality, faster sorting (migration 0007).
    task_id: Mapped[str] = mapped_column(
        String(256).with_variant(String(256, collation="C"), "postgresql")
    )


class Model(Base):
    """A model key (name@weights:pooling) and the small integer embeddings refer to it by."""

    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_key: Mapped[str] = mapped_column(String(128), unique=True)


def _set_id_column(index: bool = True) -> Mapped[int]:
    """A task set's id in a table that belongs to the set: its rows go when the set goes."""
    return mapped_column(Integer, ForeignKey("task_sets.id", ondelete="CASCADE"), index=index)


def _model_id_column(index: bool = False) -> Mapped[int]:
    """A model's id; models are never deleted (they are a registry of keys)."""
    return mapped_column(Integer, ForeignKey("models.id"), index=index)


def _set_name(set_id: Mapped[int]) -> Mapped[str]:
    """The set's name read through its id, loaded with the row (a query may compare it too)."""
    # correlate_except: a query that joins task_sets itself still reads the name from its own.
    name: ScalarSelect[str] = (
        select(TaskSet.name).where(TaskSet.id == set_id).correlate_except(TaskSet).scalar_subquery()
    )
    return column_property(name)


def _model_key(model_id: Mapped[int]) -> Mapped[str]:
    """The model's key read through its id, loaded with the row."""
    key: ScalarSelect[str] = (
        select(Model.model_key)
        .where(Model.id == model_id)
        .correlate_except(Model)
        .scalar_subquery()
    )
    return column_property(key)


# Record numbers from here up are windows of chunked documents (tasks/windows.py); every one
# below is a submitted record. Above any file's record count, below an index id's stride (2**40).
WINDOW_BASE = 2**39


class DocumentWindow(Base):
    """A chunked document: its windows are the tasks first_window .. first_window + n_windows - 1
    (record numbers, from WINDOW_BASE up); its vector, once all are stored, goes at record_no."""

    __tablename__ = "document_windows"

    task_set_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("task_sets.id", ondelete="CASCADE"), primary_key=True
    )
    record_no: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    first_window: Mapped[int] = mapped_column(BigInteger)
    n_windows: Mapped[int] = mapped_column(Integer)
    n_tokens: Mapped[int] = mapped_column(BigInteger)  # the whole document's


class TaskFailure(Base):
    """A record that failed, with a reason a user can act on (at ingest or during extraction)."""

    __tablename__ = "task_failures"
    __table_args__ = (UniqueConstraint("task_set_id", "record_no", name="uq_task_failures_record"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    task_set_id: Mapped[int] = _set_id_column(index=False)  # the unique key leads with it
    task_set: Mapped[str] = _set_name(task_set_id)
    record_no: Mapped[int] = mapped_column(BigInteger)
    task_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    stage: Mapped[str] = mapped_column(String(16))  # "ingest" or "extract"
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class BatchPlanRow(Base):
    """A plan of shape-pure batches for one task set and one consumer profile."""

    __tablename__ = "batch_plans"

    plan_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    task_set_id: Mapped[int] = _set_id_column()
    model_id: Mapped[int] = _model_id_column()
    task_set: Mapped[str] = _set_name(task_set_id)
    model_key: Mapped[str] = _model_key(model_id)
    profile_json: Mapped[str] = mapped_column(Text)
    n_batches: Mapped[int] = mapped_column(Integer)
    n_items: Mapped[int] = mapped_column(BigInteger)
    real_tokens: Mapped[int] = mapped_column(BigInteger)
    padded_tokens: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Batch(Base):
    """The batch ledger: one row per planned batch, claimed under a lease fenced by its epoch."""

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_plan_state", "plan_id", "state", "batch_no"),)

    plan_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("batch_plans.plan_id", ondelete="CASCADE"), primary_key=True
    )
    batch_no: Mapped[int] = mapped_column(Integer, primary_key=True)
    # The plan's set again: the ledger's queries select a set's batches without a join.
    task_set_id: Mapped[int] = _set_id_column()
    task_set: Mapped[str] = _set_name(task_set_id)
    # queued -> leased -> completed | failed; superseded when a newer plan replaces this one
    state: Mapped[str] = mapped_column(String(16))
    seq_len: Mapped[int] = mapped_column(Integer)
    item_start: Mapped[int] = mapped_column(BigInteger)  # into the plan's item order
    item_count: Mapped[int] = mapped_column(Integer)
    real_tokens: Mapped[int] = mapped_column(BigInteger)
    padded_tokens: Mapped[int] = mapped_column(BigInteger)
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_epoch: Mapped[int] = mapped_column(Integer, default=0)
    lease_deadline: Mapped[float | None] = mapped_column(Float, nullable=True)  # unix seconds
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The engine identity that computed the batch's rows, set with its ack
    # (fabric_gpu/engines/identity.py; migration 0016); NULL: acked before it was recorded.
    engine: Mapped[str | None] = mapped_column(String(160), nullable=True)


class Embedding(Base):
    """One pooled embedding per (model, task set, task) that computed it: written once, never
    twice. A task that reused another's result (`ReusedResult`) has no row here: the view
    `task_embeddings` holds one row per task, its own or its source's (migration 0016).

    Every column is fixed-width (the task is its record number in the set, the set and the model
    small integers), so the writer builds PostgreSQL's binary COPY payload for a whole batch with
    one NumPy structured array instead of row by row. `vector` holds float32 little-endian bytes.
    """

    __tablename__ = "embeddings"

    # The key is the idempotency key and the order an index reads a model's rows in; one index
    # only, so each row costs one index insertion.
    model_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    task_set_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    record_no: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    n_tokens: Mapped[int] = mapped_column(Integer)
    vector: Mapped[bytes] = mapped_column(LargeBinary)


class ShardWatermark(Base):
    """How often the rows of one index shard changed (raised by triggers; migration 0003)."""

    __tablename__ = "shard_watermarks"

    model_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    n_shards: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(BigInteger, default=0)


class HiddenStateShard(Base):
    """One ledger batch's hook-layer hidden states: the content-addressed Arrow file holding them.

    Keyed by the batch (migration 0004): batches of different task sets with the same task ids
    and hidden states write the same file, so several rows may name one sha256.
    """

    __tablename__ = "hidden_state_shards"
    __table_args__ = (
        ForeignKeyConstraint(
            ["plan_id", "batch_no"], ["batches.plan_id", "batches.batch_no"], ondelete="CASCADE"
        ),
    )

    plan_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    batch_no: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    task_set_id: Mapped[int] = _set_id_column()
    model_id: Mapped[int] = _model_id_column()
    task_set: Mapped[str] = _set_name(task_set_id)
    model_key: Mapped[str] = _model_key(model_id)
    layers: Mapped[str] = mapped_column(String(256))  # JSON list
    n_items: Mapped[int] = mapped_column(Integer)
    n_tokens: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)


class IndexReceipt(Base):
    """Everything needed to rebuild one vector index, as canonical JSON; its sha256 is the key."""

    __tablename__ = "index_receipts"

    receipt_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_id: Mapped[int] = _model_id_column(index=True)
    model_key: Mapped[str] = _model_key(model_id)
    index_path: Mapped[str] = mapped_column(Text)
    index_sha256: Mapped[str] = mapped_column(String(64))
    n_vectors: Mapped[int] = mapped_column(BigInteger)
    recall_at_k: Mapped[float] = mapped_column(Float)
    receipt_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class EngineSpeed(Base):
    """One measured run of an engine (migration 0009): tokens computed over seconds taken."""

    __tablename__ = "engine_speeds"
    __table_args__ = (Index("ix_engine_speeds_engine", "model_id", "backend", "layout", "device"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_id: Mapped[int] = _model_id_column()
    model_key: Mapped[str] = _model_key(model_id)
    backend: Mapped[str] = mapped_column(String(32))
    layout: Mapped[str] = mapped_column(String(16))
    device: Mapped[str] = mapped_column(String(256))
    source: Mapped[str] = mapped_column(String(256))  # e.g. "extraction of task set X"
    padded_tokens: Mapped[int] = mapped_column(BigInteger)
    real_tokens: Mapped[int] = mapped_column(BigInteger)
    seconds: Mapped[float] = mapped_column(Float)
    measured_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CalibrationRow(Base):
    """The per-dimension range a model key's int8 vectors were quantised over (migration 0012)."""

    __tablename__ = "int8_calibrations"

    model_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("models.id"), primary_key=True, autoincrement=False
    )
    model_key: Mapped[str] = _model_key(model_id)
    calibration_json: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    n_vectors: Mapped[int] = mapped_column(Integer)
    source: Mapped[str] = mapped_column(String(256))  # e.g. "first 1024 tasks of set X"
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ResultKey(Base):
    """Which task holds (or will compute) the result of each content key of a model (migration
    0016, lib/broker/reuse.py): sha256 of the model key, the hook layers and the token ids. One
    owner per key: the first task planned to compute it. A later task of the same key, in any
    set, is linked to the owner's row once that is stored.

    A bulk table like `tasks` (no foreign key: a set's keys arrive at once when it is planned);
    its rows go with their set in `tasks/catalog.forget_task_set`, after the set's rows that
    others read were handed over (store/result_links.py)."""

    __tablename__ = "result_keys"
    __table_args__ = (
        Index("ix_result_keys_task", "task_set_id", "record_no"),
        {"sqlite_with_rowid": False},  # looked up by key: the row is in the key's B-tree
    )

    model_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    content_key: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    task_set_id: Mapped[int] = mapped_column(Integer)
    record_no: Mapped[int] = mapped_column(BigInteger)


class _TaskToTask:
    """The columns of a bulk row from one task to another task's result: the task (model, set,
    record number) and the source (set, record number)."""

    model_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    task_set_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    record_no: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    from_task_set_id: Mapped[int] = mapped_column(Integer)
    from_record_no: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ReusedResult(_TaskToTask, Base):
    """A task whose result is another task's, of the same content key (lib/broker/reuse.py): the
    link is its result, read from the source's row (migration 0016: no copy). Until that row is
    stored (a duplicate inside the set whose first is still queued) the task counts as queued.

    A bulk table like `embeddings` (no foreign key: a planning links up to a million tasks at
    once); its rows go with their set in `tasks/catalog.forget_task_set`."""

    __tablename__ = "reused_results"
    __table_args__ = ({"sqlite_with_rowid": False},)  # one B-tree entry per link

    # Forgetting the source's set hands its row over to a linked task instead
    # (tasks/catalog.forget_task_set).


class AwaitedResult(_TaskToTask, Base):
    """A task waiting for a result another running set is computing (migration 0017,
    lib/broker/reuse.py): its key's owner, a task of another set, has neither its row nor a
    failure yet, and that set's workers hold a live lease. Not a result: the task counts as
    queued. When the owner's row lands the wait becomes a link (`reused_results`); if the owner
    fails, the task fails naming it; if the owner's set stops running, the waiting set takes the
    key over and computes it. Planning the set again starts its waits afresh.

    A bulk table like `reused_results` (no foreign key); its rows go with their set in
    `tasks/catalog.forget_task_set`."""

    __tablename__ = "awaited_results"
    __table_args__ = ({"sqlite_with_rowid": False},)


class ExtractionRun(Base):
    """One extraction step's efficiency record (lib/records/efficiency.py), as JSON: what `fabric
    status` shows of a set's last run."""

    __tablename__ = "extraction_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    task_set_id: Mapped[int] = _set_id_column()
    model_id: Mapped[int] = _model_id_column()
    task_set: Mapped[str] = _set_name(task_set_id)
    model_key: Mapped[str] = _model_key(model_id)
    plan_id: Mapped[str] = mapped_column(String(64))
    record_json: Mapped[str] = mapped_column(Text)
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class DatabaseIdentity(Base):
    """The database's one row: a random id made with the schema (migration 0015). A warm pool
    worker checks it against the run's, so it never serves a database made again at a URL it
    already has connections to (lib/store/identity.py)."""

    __tablename__ = "database_identity"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)


# One row per task for a model (migration 0016's view): the task's own `embeddings` row, or its
# source's through its `reused_results` link, under the task's own set and record number. The
# same columns as `embeddings`; what pgvector users and readers of a set's results query.
task_embeddings = table(
    "task_embeddings",
    column("model_id", Integer),
    column("task_set_id", Integer),
    column("record_no", BigInteger),
    column("n_tokens", Integer),
)
