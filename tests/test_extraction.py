"""Extraction through the ledger with the real model: hooks, idempotency, failures, accounting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sqlalchemy import Engine, select
from transformers import AutoModel

from fabric_gpu.manifest import EngineManifest
from fabric_gpu.model import resolve_model_dir
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.broker.plans import plan_task_set
from fabric_pipelines.lib.extraction import gather_padded
from fabric_pipelines.lib.settings import FabricPaths
from fabric_pipelines.lib.store.models import HiddenStateShard
from fabric_pipelines.lib.store.shards import read_shard
from fabric_pipelines.lib.files import CorruptFileError
from tests.pipeline_helpers import embedding_counts, run_stages, stored_embeddings

TEXTS = {
    f"t{i}": text
    for i, text in enumerate(
        [
            "The quick brown fox jumps over the lazy dog.",
            "Return the number of items in a container.",
            "Open a file and return a stream; raise OSError upon failure.",
            "hello",
            "A much longer sentence that goes on for a while, describing in some detail how "
            "a ring buffer of pinned memory hands batches to a GPU without any host thread.",
        ]
        * 6
    )
}


def _source(tmp_path: Path, extra: list[dict] | None = None) -> Path:
    rows = [{"id": k, "text": v} for k, v in TEXTS.items()] + (extra or [])
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gather_padded_places_tokens_and_padding() -> None:
    tokens = np.arange(10, dtype=np.int32)
    offsets = np.array([0, 3, 4, 10], dtype=np.int64)
    batch = gather_padded(tokens, offsets, np.array([2, 0]), 8, pad_id=-7)
    assert batch.input_ids.tolist() == [
        [4, 5, 6, 7, 8, 9, -7, -7],
        [0, 1, 2, -7, -7, -7, -7, -7],
    ]
    assert batch.lengths.tolist() == [6, 3]


@pytest.mark.slow
def test_hook_states_and_pooling_match_the_model_run_item_by_item(
    db: Engine, paths: FabricPaths, tmp_path: Path, cpu_engine, manifest: EngineManifest
) -> None:
    _, report = run_stages(db, paths, cpu_engine, manifest, _source(tmp_path), "hooks")
    assert report.batches_done > 1 and report.items_done == len(TEXTS)
    model = AutoModel.from_pretrained(str(resolve_model_dir(manifest.model_id))).eval()
    from fabric_gpu.model import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(manifest.model_id))
    pooled = stored_embeddings(db, "hooks", manifest.model_key)
    with db.connect() as conn:
        shards = conn.execute(select(HiddenStateShard)).all()
    assert sum(s.n_items for s in shards) == len(TEXTS)
    checked = 0
    for shard in shards:
        content = read_shard(Path(shard.path), shard.sha256)
        for i, task_id in enumerate(content["task_id"]):
            ids = torch.tensor([tokenizer.encode(TEXTS[task_id]).ids])
            with torch.inference_mode():
                out = model(input_ids=ids, output_hidden_states=True)
            for layer in (2, -1):
                expected = out.hidden_states[layer][0].numpy()
                got = content[f"layer_{layer}"][i].astype(np.float32)
                assert got.shape == expected.shape  # real tokens only, no padding
                np.testing.assert_allclose(got, expected, atol=2e-2, rtol=1e-2)  # stored as fp16
            np.testing.assert_allclose(
                pooled[task_id], out.last_hidden_state[0].mean(0).numpy(), atol=1e-4
            )
            checked += 1
    assert checked == len(TEXTS)


@pytest.mark.slow
def test_running_twice_writes_no_duplicates_and_accounting_balances(
    db: Engine, paths: FabricPaths, tmp_path: Path, cpu_engine, manifest: EngineManifest
) -> None:
    bad = [
        {"id": "empty", "text": ""},
        {"id": "t0", "text": "duplicate"},
        {"id": "long", "text": "x " * 400},
    ]
    source = _source(tmp_path, bad)
    summary, _ = run_stages(db, paths, cpu_engine, manifest, source, "twice")
    assert summary.n_failed == 3
    _, second = run_stages(db, paths, cpu_engine, manifest, source, "twice")
    assert second.batches_done == 0 and second.rows_inserted == 0
    # Planning again after everything is done plans nothing.
    assert plan_task_set(db, paths, "twice", manifest).plan.n_batches == 0
    rows, distinct = embedding_counts(db)
    with db.connect() as conn:
        a = accounting(conn, "twice")
    assert rows == distinct == len(TEXTS)
    assert a.finished and (a.tasks, a.completed, a.failed) == (len(TEXTS) + 3, len(TEXTS), 3)


class FlakyEngine:
    """Wraps the real engine; fails every batch that holds a given item, always."""

    def __init__(self, inner, poison_length: int) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.poison_length = inner, poison_length
        self.manifest, self.input_location = inner.manifest, inner.input_location
        self.hidden_size, self.num_layers = inner.hidden_size, inner.num_layers
        self.profile = inner.profile
        self.calls = 0

    def forward_hidden(self, ids: np.ndarray, lengths: np.ndarray):  # type: ignore[no-untyped-def]
        self.calls += 1
        if (lengths == self.poison_length).any():
            raise RuntimeError("simulated device fault")
        return self.inner.forward_hidden(ids, lengths)

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_a_batch_that_keeps_failing_fails_its_items_with_the_reason(
    db: Engine, paths: FabricPaths, tmp_path: Path, cpu_engine, manifest: EngineManifest
) -> None:
    poison = len(cpu_engine_tokens("hello"))
    flaky = FlakyEngine(cpu_engine, poison)
    _, report = run_stages(db, paths, flaky, manifest, _source(tmp_path), "flaky")
    assert report.batches_failed >= 1 and report.batches_requeued >= 2  # tried 3 times
    with db.connect() as conn:
        a = accounting(conn, "flaky")
    assert a.finished and a.failed >= 6 and a.completed + a.failed == len(TEXTS)
    assert any("simulated device fault" in e for e in report.errors)


def cpu_engine_tokens(text: str) -> list[int]:
    from fabric_gpu.model import DEFAULT_MODEL_ID, load_tokenizer

    return list(load_tokenizer(resolve_model_dir(DEFAULT_MODEL_ID)).encode(text).ids)


def test_a_corrupted_shard_is_detected_naming_the_file(tmp_path: Path) -> None:
    from fabric_pipelines.lib.store.shards import write_shard

    shard = write_shard(
        tmp_path, ["a", "b"], np.array([2, 1]), {-1: np.ones((3, 4), np.float16)}, hidden_size=4
    )
    content = read_shard(shard.path, shard.sha256)
    assert [x.shape for x in content["layer_-1"]] == [(2, 4), (1, 4)]
    data = bytearray(shard.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=shard.path.name):
        read_shard(shard.path, shard.sha256)
