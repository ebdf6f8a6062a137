"""GPU engines on a real GPU, driven by the runtime exactly as in production: CUDA graphs per
shape, gather kernel, hook copies, payload ring poisoned with NaN first, drained to the host.
Compared with the fp32 CPU reference on the same weights (random, and the real MiniLM).

Marked `gpu`; skipped with the reason where no GPU is present. The real-weights test reads the
model from FABRIC_MINILM_DIR, or the packaged all-MiniLM-L6-v2 where that is installed.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fabric_gpu.manifest import EngineManifest, HookSpec
from fabric_gpu.profile import ConsumerProfile
from tests.gpu_marks import TORCH_GPU

pytestmark = TORCH_GPU

PROFILE = ConsumerProfile(4096, 64, 256, 8)
HOOKS = (2, -1)


def _manifest(dtype: str, model_id: str = "random") -> EngineManifest:
    return EngineManifest.from_mapping(
        {
            "model_id": model_id, "weights_sha256": "0" * 64, "backend": "torch", "dtype": dtype,
            "max_batch_tokens": PROFILE.max_batch_tokens, "max_batch_items": PROFILE.max_batch_items,
            "max_seq_len": PROFILE.max_seq_len, "seq_granularity": PROFILE.seq_granularity,
            "hooks": HookSpec(HOOKS, "mean").to_mapping(),
        }
    )  # fmt: skip


def _random_bert(seed: int = 0) -> Any:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        intermediate_size=1024, max_position_embeddings=512,
    )  # fmt: skip
    return BertModel(config, add_pooling_layer=False).eval()


def _random_mpnet(seed: int = 0) -> Any:
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(seed)
    config = MPNetConfig(
        vocab_size=30527, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        intermediate_size=1024, max_position_embeddings=514,
    )  # fmt: skip
    return MPNetModel(config, add_pooling_layer=False).eval()


def _minilm_dir() -> Path | None:
    env = os.environ.get("FABRIC_MINILM_DIR")
    if env and Path(env).is_dir():
        return Path(env)
    try:
        from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir

        return resolve_model_dir(DEFAULT_MODEL_ID)
    except Exception:
        return None


def plan_and_shapes(engine: Any, lengths: np.ndarray) -> tuple[Any, list[tuple[int, int]]]:
    """The planner's batches of `lengths` for the engine, and the shapes it captures for them."""
    from fabric_gpu.batching import plan_batches

    plan = plan_batches(lengths, PROFILE.with_layout(engine.layout))
    pairs = {
        (int(s), int(plan.item_count[plan.seq_len == s].max())) for s in np.unique(plan.seq_len)
    }
    return plan, engine.shapes_for(sorted(pairs))


def _run(
    engine: Any, lengths: np.ndarray, seed: int
) -> tuple[np.ndarray, np.ndarray, dict[int, dict[int, np.ndarray]], dict[str, Any]]:
    """Drive `engine` through the runtime over items of `lengths`; returns tokens, offsets, and
    per item its pooled vector and hook states."""
    from fabric_gpu.runtime import GpuEngineRunner

    rng = np.random.default_rng(seed)
    tokens = rng.integers(1000, 30000, int(lengths.sum())).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    plan, shapes = plan_and_shapes(engine, lengths)
    results: dict[int, Any] = {}
    runner = GpuEngineRunner(
        engine,
        tokens,
        offsets,
        lambda r: results.__setitem__(r.batch_id, r),
        shapes=shapes,
        poison=True,
    )
    allocated = torch.cuda.memory_allocated()
    # Batches before the heap count is taken as the baseline (then at least as many after it).
    warm_up = min(8, plan.n_batches // 2)
    heap_warm = 0
    with runner:
        for b in range(plan.n_batches):
            if b == warm_up:
                heap_warm = runner.finish().heap_allocations
            rows = plan.order[plan.item_start[b] : plan.item_start[b] + plan.item_count[b]]
            runner.submit(b, rows, int(plan.seq_len[b]))
        stats = runner.finish().as_dict()
    stats["heap_allocations_after_warmup"] = stats["heap_allocations"] - heap_warm
    stats["torch_allocated_delta"] = torch.cuda.memory_allocated() - allocated
    per_item: dict[int, dict[int, np.ndarray]] = {}
    pooled_by_item: dict[int, np.ndarray] = {}
    for b in range(plan.n_batches):
        rows = plan.order[plan.item_start[b] : plan.item_start[b] + plan.item_count[b]]
        r = results[b]
        assert r.error == ""
        at = 0
        for i, row in enumerate(rows):
            n = int(lengths[row])
            pooled_by_item[int(row)] = r.pooled[i]
            per_item[int(row)] = {layer: r.hooks[layer][at : at + n] for layer in HOOKS}
            at += n
    stats["pooled"] = pooled_by_item
    return tokens, offsets, per_item, stats


def _check_against_cpu(
    reference: Any, tokens: np.ndarray, offsets: np.ndarray, per_item: Any, stats: Any, items: int
) -> None:
    worst_cos, worst_rel = 1.0, 0.0
    for row in range(items):
        ids = torch.from_numpy(tokens[offsets[row] : offsets[row + 1]].astype(np.int64))[None]
        with torch.inference_mode():
            out = reference(input_ids=ids, output_hidden_states=True)
        expected = out.last_hidden_state[0].mean(0).numpy()
        got = stats["pooled"][row]
        assert np.isfinite(got).all(), "an output element was never written (poisoned NaN)"
        cos = float(got @ expected / (np.linalg.norm(got) * np.linalg.norm(expected)))
        worst_cos = min(worst_cos, cos)
        for layer in HOOKS:
            h = per_item[row][layer].astype(np.float32)
            assert np.isfinite(h).all()
            ref = out.hidden_states[layer][0].numpy()
            worst_rel = max(worst_rel, float(np.linalg.norm(h - ref) / np.linalg.norm(ref)))
    assert worst_cos >= 0.999, f"worst pooled cosine {worst_cos:.6f}"
    assert worst_rel <= 1e-2, f"worst hook relative error {worst_rel:.4f}"


@pytest.mark.parametrize(
    ("dtype", "layout"), [("float16", "packed"), ("bfloat16", "packed"), ("float16", "padded")]
)
def test_random_weights_through_the_runtime_match_the_cpu_reference(
    dtype: str, layout: str
) -> None:
    from fabric_gpu.engines.torch_engine import TorchEngine

    reference = _random_bert()
    engine = TorchEngine(_manifest(dtype), model=copy.deepcopy(reference), layout=layout)
    lengths = np.random.default_rng(1).integers(1, 257, 300)
    tokens, offsets, per_item, stats = _run(engine, lengths, seed=2)
    _check_against_cpu(reference, tokens, offsets, per_item, stats, len(lengths))
    assert stats["device_allocations"] == stats["device_allocations_at_start"], (
        "runtime allocated device memory in the hot loop"
    )
    assert stats["heap_allocations"] > 0, "the heap counter sees the runtime's start"
    assert stats["heap_allocations_after_warmup"] == 0, "runtime allocated heap in the hot loop"
    assert stats["torch_allocated_delta"] == 0, "torch allocated in the hot loop"


def test_float32_on_the_packed_layout_is_refused_naming_the_field() -> None:
    """FlashAttention's varlen kernel takes half precision only: the engine says so when it is
    made, rather than failing inside the first batch."""
    from fabric_gpu.engines.base import EngineError
    from fabric_gpu.engines.torch_engine import TorchEngine

    with pytest.raises(EngineError, match=r"dtype 'float32'.*float16"):
        TorchEngine(_manifest("float32"), model=_random_bert(), layout="packed")


def test_random_mpnet_through_the_runtime_matches_the_cpu_reference() -> None:
    """MPNet (all-mpnet-base-v2's architecture) runs padded, through the Hugging Face module
    captured as CUDA graphs: its relative position bias comes with it."""
    from fabric_gpu.engines.torch_engine import TorchEngine

    reference = _random_mpnet()
    engine = TorchEngine(_manifest("float16"), model=copy.deepcopy(reference), layout="padded")
    lengths = np.random.default_rng(3).integers(1, 257, 200)
    tokens, offsets, per_item, stats = _run(engine, lengths, seed=4)
    _check_against_cpu(reference, tokens, offsets, per_item, stats, len(lengths))


def test_real_minilm_through_the_runtime_matches_the_cpu_reference() -> None:
    from transformers import AutoModel

    from fabric_gpu.engines.torch_engine import TorchEngine

    model_dir = _minilm_dir()
    if model_dir is None:
        pytest.skip("the real all-MiniLM-L6-v2 is not available (set FABRIC_MINILM_DIR)")
    reference = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    engine = TorchEngine(_manifest("float16", str(model_dir)), model=copy.deepcopy(reference))
    lengths = np.random.default_rng(5).integers(1, 257, 300)
    tokens, offsets, per_item, stats = _run(engine, lengths, seed=6)
    _check_against_cpu(reference, tokens, offsets, per_item, stats, len(lengths))


def test_fused_kernels_match_their_twins() -> None:
    from fabric_gpu.engines import fused

    if not fused.HAVE_TRITON:
        pytest.skip("Triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    for hidden in (384, 768, 1024):
        x = torch.randn(1000, hidden, device="cuda", dtype=torch.float16, generator=g)
        r = torch.randn_like(x)
        w = torch.randn(hidden, device="cuda", dtype=torch.float16, generator=g)
        b = torch.randn_like(w)
        torch.testing.assert_close(
            fused.add_layer_norm(x, r, w, b, 1e-12),
            fused.add_layer_norm_reference(x, r, w, b, 1e-12), atol=2e-2, rtol=1e-2,
        )  # fmt: skip
        word = torch.randn(500, hidden, device="cuda", dtype=torch.float16, generator=g)
        pos = torch.randn(512, hidden, device="cuda", dtype=torch.float16, generator=g)
        ids = torch.randint(0, 500, (1000,), device="cuda", generator=g)
        positions = torch.randint(0, 512, (1000,), device="cuda", generator=g)
        torch.testing.assert_close(
            fused.embed_layer_norm(ids, positions, word, pos, w, w, b, 1e-12),
            fused.embed_layer_norm_reference(ids, positions, word, pos, w, w, b, 1e-12),
            atol=2e-2, rtol=1e-2,
        )  # fmt: skip


def test_a_prewarmed_worker_engine_captured_the_full_shape_and_still_matches() -> None:
    """A warm worker captures a packed plan's full-batch graph before the plan exists; the run
    then captures only the plan's other shapes, and its outputs still match the CPU reference."""
    from fabric_gpu.engines.torch_engine import TorchEngine
    from fabric_pipelines.lib.worker.main import prewarm

    reference = _random_bert()
    engine = TorchEngine(_manifest("float16"), model=copy.deepcopy(reference), layout="packed")
    prewarm(engine)
    assert list(engine.captured) == [PROFILE.max_batch_tokens]
    lengths = np.random.default_rng(3).integers(1, 257, 300)
    tokens, offsets, per_item, stats = _run(engine, lengths, seed=4)
    assert PROFILE.max_batch_tokens in engine.captured
    _check_against_cpu(reference, tokens, offsets, per_item, stats, len(lengths))
