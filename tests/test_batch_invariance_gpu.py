"""The torch engine's batch-invariance contract on a real GPU, through the runtime as in
production (CUDA graphs per shape, packed fp16): the same token ids give the same pooled bytes
whatever plan, batch, row, neighbours or tail they ride in, and run after run.

Marked `gpu`; skipped with the reason where no GPU is present. The CPU engine's side of the
contract is tests/test_batch_invariance.py (the real MiniLM, through the product).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from tests.gpu_marks import TORCH_GPU
from tests.test_engines_gpu import PROFILE, _manifest, _random_bert, plan_and_shapes

pytestmark = [*TORCH_GPU, pytest.mark.timeout(600)]


def _pooled_bytes(engine: Any, items: list[np.ndarray]) -> list[bytes]:
    """Each item's pooled vector as bytes, the items planned and run as one task set."""
    from fabric_gpu.runtime import GpuEngineRunner

    lengths = np.array([len(t) for t in items], dtype=np.int64)
    tokens = np.concatenate(items).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    plan, shapes = plan_and_shapes(engine, lengths)
    results: dict[int, Any] = {}
    runner = GpuEngineRunner(
        engine, tokens, offsets, lambda r: results.__setitem__(r.batch_id, r), shapes=shapes
    )
    with runner:
        for b in range(plan.n_batches):
            rows = plan.order[plan.item_start[b] : plan.item_start[b] + plan.item_count[b]]
            runner.submit(b, rows, int(plan.seq_len[b]))
        runner.finish()
    out: dict[int, bytes] = {}
    for b in range(plan.n_batches):
        rows = plan.order[plan.item_start[b] : plan.item_start[b] + plan.item_count[b]]
        assert results[b].error == ""
        for i, row in enumerate(rows):
            out[int(row)] = np.ascontiguousarray(results[b].pooled[i], dtype="<f4").tobytes()
    return [out[i] for i in range(len(items))]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_sequence_gets_the_same_bytes_in_any_batch_on_the_gpu(dtype: str) -> None:
    from fabric_gpu.engines.torch_engine import TorchEngine

    engine = TorchEngine(_manifest(dtype), model=copy.deepcopy(_random_bert()), layout="packed")
    rng = np.random.default_rng(39)
    lengths = rng.integers(1, PROFILE.max_seq_len + 1, 240)
    items = [rng.integers(1000, 30000, n).astype(np.int32) for n in lengths]

    everything = _pooled_bytes(engine, items)
    # Another set: a third of them, shuffled, with sequences of their own around them.
    picked = rng.permutation(len(items))[:80]
    others = [rng.integers(1000, 30000, n).astype(np.int32) for n in rng.integers(1, 200, 50)]
    mixed = [items[i] for i in picked] + others
    order = rng.permutation(len(mixed))
    in_mix = _pooled_bytes(engine, [mixed[i] for i in order])
    position = {int(j): k for k, j in enumerate(order)}
    alone = {i: _pooled_bytes(engine, [items[i]])[0] for i in picked[:12].tolist()}
    again = _pooled_bytes(engine, items)

    assert again == everything, "run to run: the same plan twice gave other bytes"
    differ = [int(i) for k, i in enumerate(picked) if in_mix[position[k]] != everything[int(i)]]
    assert not differ, f"{len(differ)} of {len(picked)} sequences changed bytes in another set"
    differ_alone = [i for i, got in alone.items() if got != everything[i]]
    assert not differ_alone, f"sequences {differ_alone} alone differ from in a full batch"
