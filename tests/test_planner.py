"""Planner properties: every item in exactly one batch, shape-pure, within all four limits; and
planning a finished set again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from fabric_gpu.batching import plan_batches
from fabric_gpu.manifest import EngineManifest
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import accounting, report_failure
from fabric_pipelines.lib.broker.plans import current_plan, load_plan_order, plan_id, plan_task_set
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.models import Batch, BatchPlanRow
from fabric_pipelines.lib.tasks.arrow_files import read_table
from fabric_pipelines.lib.tasks.catalog import get_task_set, ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from tests.ledger_helpers import claim


@st.composite
def profiles_and_lengths(draw):  # type: ignore[no-untyped-def]
    granularity = draw(st.sampled_from([1, 4, 8, 32]))
    max_seq_len = granularity * draw(st.integers(1, 64))
    max_batch_tokens = draw(st.integers(max_seq_len, max_seq_len * 40))
    max_batch_items = draw(st.integers(1, 300))
    profile = ConsumerProfile(max_batch_tokens, max_batch_items, max_seq_len, granularity)
    lengths = draw(st.lists(st.integers(1, max_seq_len), min_size=0, max_size=400))
    subset = draw(st.booleans())
    return profile, np.array(lengths, dtype=np.int64), subset


@settings(max_examples=300, deadline=None)
@given(profiles_and_lengths())
def test_plan_properties(case) -> None:  # type: ignore[no-untyped-def]
    profile, lengths, subset = case
    rows = np.arange(lengths.size)[::2] if subset else None
    plan = plan_batches(lengths, profile, rows)
    expected = np.arange(lengths.size)[::2] if subset else np.arange(lengths.size)
    # every item exactly once
    assert sorted(plan.order.tolist()) == expected.tolist()
    # batches tile the order without gaps or overlaps
    assert (
        plan.item_start.tolist()
        == np.concatenate([[0], np.cumsum(plan.item_count)[:-1]]).tolist()[: plan.n_batches]
    )
    assert int(plan.item_count.sum()) == expected.size
    for b in range(plan.n_batches):
        items = plan.order[plan.item_start[b] : plan.item_start[b] + plan.item_count[b]]
        padded = -(-lengths[items] // profile.seq_granularity) * profile.seq_granularity
        assert (padded == plan.seq_len[b]).all(), "shape-pure: one padded length per batch"
        assert 1 <= plan.item_count[b] <= profile.max_batch_items
        assert plan.seq_len[b] <= profile.max_seq_len
        assert plan.seq_len[b] * plan.item_count[b] <= profile.max_batch_tokens
        assert plan.real_tokens[b] == lengths[items].sum()


def test_padding_is_only_the_granularity_rounding() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4.3, 0.8, 50_000).astype(np.int64), 8, 512)
    profile = ConsumerProfile(32768, 1024, 512, 8)
    plan = plan_batches(lengths, profile)
    floor = 1 - lengths.sum() / (-(-lengths // 8) * 8).sum()
    assert abs(plan.padding_fraction - floor) < 1e-12
    # buckets are split evenly: no batch is less than half the size of its bucket's largest
    for length in np.unique(plan.seq_len):
        counts = plan.item_count[plan.seq_len == length]
        assert counts.max() - counts.min() <= 1


def test_plan_id_is_deterministic_and_sensitive() -> None:
    p = ConsumerProfile(4096, 64, 128, 8)
    rows = np.arange(10)
    assert plan_id("a" * 64, "m", p, rows) == plan_id("a" * 64, "m", p, rows)
    assert plan_id("a" * 64, "m", p, rows) != plan_id("a" * 64, "m", p, rows[:-1])
    assert plan_id("a" * 64, "m", p, rows) != plan_id("a" * 64, "m2", p, rows)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 512), max_size=600),
    max_tokens=st.sampled_from([512, 1024, 4096]),
    max_items=st.integers(1, 64),
)
def test_packed_plan_properties(lengths: list[int], max_tokens: int, max_items: int) -> None:
    from fabric_gpu.profile import PACKED_GRANULARITY

    profile = ConsumerProfile(max_tokens, max_items, 512, 8, layout="packed")
    arr = np.array(lengths, dtype=np.int64)
    plan = plan_batches(arr, profile)
    assert plan.order.tolist() == list(range(len(lengths))), "arrival order, every item once"
    assert int(plan.item_count.sum()) == len(lengths)
    for b in range(plan.n_batches):
        items = plan.order[plan.item_start[b] : plan.item_start[b] + plan.item_count[b]]
        real = int(arr[items].sum())
        assert real == plan.real_tokens[b] <= max_tokens
        assert 1 <= plan.item_count[b] <= max_items
        assert (
            plan.seq_len[b]
            == plan.padded_tokens[b]
            == max(PACKED_GRANULARITY, -(-real // 512) * 512)
        )
        assert plan.seq_len[b] <= max_tokens
        if b + 1 < plan.n_batches and plan.item_count[b] < max_items:
            # greedy: the next item would not have fitted
            assert real + arr[plan.order[plan.item_start[b + 1]]] > max_tokens


def test_packed_padding_is_small_on_the_reference_lengths() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4.3, 0.8, 20_000).astype(np.int64), 8, 512)
    plan = plan_batches(lengths, ConsumerProfile(32768, 1024, 512, 8, layout="packed"))
    assert plan.padding_fraction < 0.03


@settings(max_examples=100, deadline=None)
@given(
    prefixes=st.lists(
        st.lists(st.integers(100, 104), min_size=1, max_size=6), min_size=1, max_size=8
    ),
    picks=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 20)), min_size=1, max_size=120),
)
def test_items_sharing_a_prefix_are_adjacent_within_their_bucket(prefixes, picks) -> None:  # type: ignore[no-untyped-def]
    from fabric_gpu.batching import prefix_keys

    prefix = 4
    items = [prefixes[p % len(prefixes)] + [200 + tail] * (1 + tail % 3) for p, tail in picks]
    lengths = np.array([len(t) for t in items], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate([np.array(t, np.int32) for t in items])
    profile = ConsumerProfile(64, 8, 16, 4)
    plan = plan_batches(lengths, profile, keys=prefix_keys(tokens, offsets, prefix=prefix))
    assert sorted(plan.order.tolist()) == list(range(len(items)))
    position = {row: i for i, row in enumerate(plan.order.tolist())}
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for row, t in enumerate(items):
        bucket = -(-len(t) // 4) * 4
        groups.setdefault((bucket, tuple(t[:prefix])), []).append(position[row])
    for places in groups.values():
        assert max(places) - min(places) == len(places) - 1, "prefix-sharing items are adjacent"


def test_planning_a_finished_set_again_keeps_its_plan(
    db: Engine, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest
) -> None:
    """Every item retired (here: failed for good), the set is planned again: the plan that did
    the work stays current, no empty plan takes its place, no ledger row is added."""
    source = tmp_path / "s.jsonl"
    source.write_text("".join(json.dumps({"id": i, "text": f"item {i}"}) + "\n" for i in range(30)))
    submit(source, paths.inbox, "done")
    ingest_task_set(
        db, paths, "done", model_id=manifest.model_id, max_seq_len=manifest.profile.max_seq_len
    )
    first = plan_task_set(db, paths, "done", manifest)
    assert first.new_batches == first.plan.n_batches > 0
    stored = get_task_set(db, "done")
    tasks = read_table(Path(stored.path), stored.content_sha256)
    record_no, ids = tasks.column("record_no").to_pylist(), tasks.column("id").to_pylist()
    order = load_plan_order(first.path, first.sha256)
    while (lease := claim(db, first.plan_id, "test", lease_seconds=60)) is not None:
        rows = order[lease.item_start : lease.item_start + lease.item_count]
        items = [(record_no[r], ids[r]) for r in rows]
        report_failure(db, lease, "poisoned", max_attempts=1, failed_items=items, task_set="done")

    again = plan_task_set(db, paths, "done", manifest)
    assert (again.plan_id, again.path, again.sha256) == (first.plan_id, first.path, first.sha256)
    assert (again.outstanding, again.new_batches) == (0, 0)
    # Described as it was made (what the asset's metadata shows): the same batches, not none.
    for field in ("order", "seq_len", "item_start", "item_count", "real_tokens", "padded_tokens"):
        assert np.array_equal(getattr(again.plan, field), getattr(first.plan, field)), field
    assert again.padding_by_bucket() == first.padding_by_bucket()
    assert current_plan(db, "done").plan_id == first.plan_id
    with Session(db) as session:
        assert session.scalars(select(BatchPlanRow.plan_id)).all() == [first.plan_id]
        assert session.scalar(select(func.count()).select_from(Batch)) == first.plan.n_batches
    with db.connect() as conn:
        a = accounting(conn, "done")
    assert a.finished and (a.tasks, a.failed) == (30, 30)
