"""Batch-invariant vectors on the CPU engine, the contract reuse rests on: the same token ids give
the same bytes whatever batch, position, set or run they come in.

The CPU engine's bytes depend on the padded length a text is computed at (the reductions over the
sequence change with it: 129 of 192 texts differ between their own length and the longest of a
batch), and on nothing else: not the batch's rows, nor the text's row. The plan computes every
text at its bucket's length (`ConsumerProfile.bucket_length`, a function of its length alone), so
a text gets the same bytes in every batch, set and run, given MKL's strict reproducibility mode
(fabric_gpu/__init__.py: without it, on AVX-512, 119 of 200 texts differed alone and in full
batches). Checked here with the real
all-MiniLM-L6-v2 (its own pooling and normalisation) on 200 texts of mixed length, tokenised by
its own tokenizer and submitted as token ids:
- the engine: each text alone at its bucket's length; in full batches of its bucket (32 rows);
  in a tail batch of fewer rows; at another row among other texts of its bucket;
- the product: the 200 as one set extracted in this process, and again shuffled among 100 other
  texts as a second set with reuse off, extracted by a worker process of its own (another run,
  another engine, other batches).
Every copy of a text's vector is the same bytes as the one it got alone.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from sqlalchemy import Engine

from fabric_gpu.engines import create_engine
from fabric_gpu.engines.base import PaddedBatch
from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir
from fabric_gpu.model_defaults import model_defaults
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.plans import plan_task_set
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.steps.run_extraction import extract_task_set
from fabric_pipelines.lib.tasks.catalog import ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from tests.pipeline_helpers import stored_embeddings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORDS = [
    "the", "index", "keeps", "every", "vector", "of", "a", "task", "set", "while", "workers",
    "pull", "batches", "from", "ledger", "and", "nothing", "is", "lost", "when", "node", "goes",
    "away", "or", "lease", "runs", "out", "before", "its", "heartbeat",
]  # fmt: skip


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    # Mixed lengths: 1 to 120 words, so buckets and padding differ from batch to batch.
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8, 20, 45, 80, 120]))) + f" {i}"
        for i in range(n)
    ]


def _token_ids(texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(DEFAULT_MODEL_ID)))
    return [tokenizer(t, truncation=True, max_length=256)["input_ids"] for t in texts]


def _manifest() -> EngineManifest:
    defaults = model_defaults(resolve_model_dir(DEFAULT_MODEL_ID))
    return manifest_for_model(
        DEFAULT_MODEL_ID, backend="cpu", dtype="float32",
        profile=ConsumerProfile(32 * 256, 32, 256, 8),
        hooks=HookSpec((), defaults.default_pooling(), defaults.normalize),
    )  # fmt: skip


def _forward(engine: object, rows: list[list[int]], width: int) -> list[bytes]:
    """The texts' vectors, computed in one batch padded to `width`."""
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    batch = PaddedBatch(ids, np.asarray([len(r) for r in rows], dtype=np.int64))
    pooled = engine.forward(batch).pooled  # type: ignore[attr-defined]
    return [np.ascontiguousarray(v, dtype="<f4").tobytes() for v in pooled]


def _buckets(ids: list[list[int]]) -> dict[int, list[int]]:
    """The texts of each bucket length, as the plan groups them."""
    profile = _manifest().profile
    buckets: dict[int, list[int]] = {}
    for i, row in enumerate(ids):
        buckets.setdefault(profile.bucket_length(len(row)), []).append(i)
    return buckets


@pytest.fixture(scope="module")
def ids_and_alone() -> tuple[list[list[int]], list[bytes]]:
    """The texts' token ids, and each one's vector computed alone at its bucket's length."""
    ids = _token_ids(_texts(200, seed=39))
    profile = _manifest().profile
    engine = create_engine(_manifest())
    try:
        alone = [_forward(engine, [row], profile.bucket_length(len(row)))[0] for row in ids]
    finally:
        engine.close()
    return ids, alone


def test_the_engine_gives_a_text_the_same_bytes_alone_in_full_and_tail_batches_and_any_row(
    ids_and_alone: tuple[list[list[int]], list[bytes]],
) -> None:
    ids, alone = ids_and_alone
    rows = _manifest().profile.max_batch_items
    engine = create_engine(_manifest())
    got: dict[str, dict[int, bytes]] = {"full": {}, "tail": {}, "shuffled": {}}
    try:
        for width, members in _buckets(ids).items():
            # Full batches of the bucket (topped up with the bucket's own texts again), a tail
            # batch of what is left, and the bucket shuffled: every text at another row.
            total = -(-len(members) // rows) * rows
            padded = (members * (total // len(members) + 1))[:total]
            for start in range(0, len(padded) - rows + 1, rows):
                chunk = padded[start : start + rows]
                got["full"].update(
                    zip(chunk, _forward(engine, [ids[i] for i in chunk], width), strict=True)
                )
            tail = members[: max(1, len(members) % rows or len(members) // 2)]
            got["tail"].update(
                zip(tail, _forward(engine, [ids[i] for i in tail], width), strict=True)
            )
            shuffled = list(members)
            random.Random(width).shuffle(shuffled)
            for start in range(0, len(shuffled), rows):
                chunk = shuffled[start : start + rows]
                got["shuffled"].update(
                    zip(chunk, _forward(engine, [ids[i] for i in chunk], width), strict=True)
                )
    finally:
        engine.close()
    for way, vectors in got.items():
        differ = [i for i, v in vectors.items() if v != alone[i]]
        assert not differ, f"{way}: {len(differ)} of {len(vectors)} differ from alone: {differ[:5]}"
    assert len(got["full"]) == len(got["shuffled"]) == len(ids)


def _submit_ids(paths: FabricPaths, name: str, tasks: list[tuple[str, list[int]]]) -> None:
    source = paths.root / f"{name}.jsonl"
    source.write_text(
        "".join(json.dumps({"id": tid, "token_ids": row}) + "\n" for tid, row in tasks)
    )
    submit(source, paths.inbox, name)


def test_a_text_has_the_same_bytes_in_another_set_and_another_run(
    db: Engine,
    db_url: str,
    paths: FabricPaths,
    ids_and_alone: tuple[list[list[int]], list[bytes]],
) -> None:
    ids, alone = ids_and_alone
    manifest = _manifest()
    tasks = [(f"t{i}", row) for i, row in enumerate(ids)]
    others = [(f"o{i}", row) for i, row in enumerate(_token_ids(_texts(100, seed=40)))]
    mixed = tasks + others
    random.Random(11).shuffle(mixed)
    for name, rows in (("first", tasks), ("second", mixed)):
        _submit_ids(paths, name, rows)
        ingest_task_set(db, paths, name, model_id=manifest.model_id, max_seq_len=256)
        plan_task_set(db, paths, name, manifest, reuse=False)
    # The first in this process; the second by a worker process of its own, with other batches.
    extract_task_set(db, paths, "first", manifest, database_url=db_url, workers=0)
    extract_task_set(
        db, paths, "second", manifest, database_url=db_url, workers=1, pool_idle_seconds=0
    )
    first, second = (
        {task: v.tobytes() for task, v in stored_embeddings(db, name, manifest.model_key).items()}
        for name in ("first", "second")
    )
    assert len(first) == 200 and len(second) == 300
    for i in range(len(ids)):
        assert first[f"t{i}"] == alone[i], f"t{i}: the first set's bytes differ from alone"
        assert second[f"t{i}"] == alone[i], f"t{i}: the second set's bytes differ from alone"
