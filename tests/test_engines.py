"""The GPU engines' code paths that run on the CPU: the packed forward against Hugging Face,
the torch engine's eager forward against the reference engine, the ONNX export with onnxruntime,
and the TensorRT backend's profiles and its error where TensorRT is missing."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fabric_gpu.engines import EngineError, input_layout
from fabric_gpu.engines.bert_checkpoint import read_bert_checkpoint
from fabric_gpu.engines.packed_bert import PackedBert, UnsupportedModelError
from fabric_gpu.engines.torch_engine import (
    LengthCachedBias,
    TorchEngine,
    additive_mask,
    packed_capacity,
)
from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir
from fabric_gpu.profile import ConsumerProfile


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(resolve_model_dir(DEFAULT_MODEL_ID))).eval()


def packed_inputs(
    lengths: list[int],
    capacity: int,
    max_items: int,
    pad_id: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Host-side twin of the gather kernel's packed layout, the test's inputs: positions,
    seq ids and cu_seqlens of items of `lengths` placed back to back in `capacity` tokens."""
    real = sum(lengths)
    if real > capacity or len(lengths) > max_items:
        raise ValueError("items do not fit the shape")
    positions = torch.zeros(capacity, dtype=torch.int64)
    seq_ids = torch.full((capacity,), max_items, dtype=torch.int64)
    cu = torch.full((max_items + 2,), capacity, dtype=torch.int32)
    at = 0
    for i, n in enumerate(lengths):
        cu[i] = at
        positions[at : at + n] = torch.arange(n)
        seq_ids[at : at + n] = i
        at += n
    cu[len(lengths)] = real
    return {
        "positions": positions.to(device),
        "seq_ids": seq_ids.to(device),
        "cu_seqlens": cu.to(device),
        "pad_id": torch.tensor(pad_id),
    }


def _reference(model: Any, ids: torch.Tensor) -> Any:
    with torch.inference_mode():
        return model(input_ids=ids[None], output_hidden_states=True)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_packed_forward_matches_hugging_face_item_by_item(hf_model: Any, pooling: str) -> None:
    packed = PackedBert.from_model(hf_model)
    lengths = [7, 31, 2, 64, 19]
    capacity, max_items = packed_capacity(sum(lengths)), 8
    inputs = packed_inputs(lengths, capacity, max_items)
    ids = torch.randint(1000, 30000, (capacity,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        pooled, hooks = packed.forward(
            ids, inputs["positions"], inputs["seq_ids"], inputs["cu_seqlens"], 512, max_items + 1,
            (0, 3, 6), pooling,
        )  # fmt: skip
    at = 0
    for i, n in enumerate(lengths):
        ref = _reference(hf_model, ids[at : at + n])
        last = ref.last_hidden_state[0]
        expected = {"mean": last.mean(0), "cls": last[0], "last": last[-1]}[pooling]
        assert torch.nn.functional.cosine_similarity(pooled[i], expected, dim=0) > 0.99999
        for hook, layer in zip(hooks, (0, 3, 6), strict=True):
            torch.testing.assert_close(
                hook[at : at + n], ref.hidden_states[layer][0], atol=1e-4, rtol=1e-4
            )
        at += n


def test_packed_forward_refuses_other_architectures() -> None:
    from transformers import GPT2Config, GPT2Model

    with pytest.raises(UnsupportedModelError, match="BERT-architecture"):
        PackedBert.from_model(GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2)))


def _small_encoder(architecture: str) -> Any:
    import transformers

    common = dict(
        vocab_size=600, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=130,
    )  # fmt: skip
    config_class, model_class = {
        "mpnet": (transformers.MPNetConfig, transformers.MPNetModel),
        "roberta": (transformers.RobertaConfig, transformers.RobertaModel),
        "bert": (transformers.BertConfig, transformers.BertModel),
    }[architecture]
    torch.manual_seed(0)
    return model_class(config_class(**common), add_pooling_layer=False).eval()


@pytest.mark.parametrize("architecture", ["mpnet", "roberta", "bert"])
def test_the_ready_additive_mask_gives_the_modules_own_result(architecture: str) -> None:
    """Encoders the packed path cannot run get a ready 4-D mask (Hugging Face's own 2-D mask
    handling copies a host scalar to the GPU, which graph capture refuses); it must change
    nothing: the real tokens' states equal those the module computes from the 2-D mask."""
    model = _small_encoder(architecture)
    lengths = [7, 3, 12, 1]
    ids = torch.randint(5, 600, (len(lengths), 12))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, 1)  # the padding id of RoBERTa's config
    with torch.inference_mode():
        own = model(input_ids=ids, attention_mask=mask).last_hidden_state
        ready = model(input_ids=ids, attention_mask=additive_mask(mask, torch.float32))
    real = mask.bool()
    torch.testing.assert_close(ready.last_hidden_state[real], own[real], atol=1e-5, rtol=1e-5)


def test_mpnet_position_bias_cached_per_length_changes_nothing() -> None:
    """MPNet's relative position bias is computed once per sequence length (outside graph
    capture) and replayed: outputs equal the module's own, whatever the batch size."""
    import copy

    model = _small_encoder("mpnet")
    cached = copy.deepcopy(model)
    bias = LengthCachedBias(cached.encoder.compute_position_bias)
    cached.encoder.compute_position_bias = bias
    with torch.inference_mode():
        for rows, length in ((3, 9), (5, 9), (2, 17)):
            ids = torch.randint(5, 600, (rows, length))
            mask = torch.ones_like(ids)
            mask[0, length // 2 :] = 0
            own = model(input_ids=ids, attention_mask=mask).last_hidden_state
            replayed = cached(input_ids=ids, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(replayed, own, atol=1e-6, rtol=1e-6)
    assert sorted(bias.by_length) == [(9, 32), (17, 32)]  # one bias per length, shared by sizes


def _packed_tensors(packed: PackedBert) -> list[torch.Tensor]:
    tensors = [packed.word, packed.position, packed.token_type, *packed.emb_ln]
    for layer in packed.layers:
        tensors += [getattr(layer, f.name) for f in dataclasses.fields(layer)]
    return tensors


def _copy_model_dir(tmp_path: Path, weights: dict[str, torch.Tensor], name: str) -> Path:
    """The default model's config beside `weights` saved as `name` (safetensors or .bin)."""
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(resolve_model_dir(DEFAULT_MODEL_ID) / "config.json", folder)
    weights = {k: v.detach().contiguous() for k, v in weights.items()}
    if name.endswith(".safetensors"):
        save_file(weights, str(folder / name))
    else:
        torch.save(weights, folder / name)
    return folder


@pytest.mark.parametrize(
    "layout",
    ["as saved", "task model (bert. prefix, gamma/beta)", "pytorch_model.bin"],
)
def test_bert_checkpoint_reads_the_same_weights_as_transformers(
    hf_model: Any, tmp_path: Path, layout: str
) -> None:
    state = dict(hf_model.state_dict())
    name = "model.safetensors"
    if layout.startswith("task"):
        state = {
            "bert."
            + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
                "LayerNorm.bias", "LayerNorm.beta"
            ): v
            for k, v in state.items()
        }
        state["cls.predictions.bias"] = torch.zeros(3)  # a task head: ignored
    elif layout == "pytorch_model.bin":
        name = "pytorch_model.bin"
    folder = _copy_model_dir(tmp_path, state, name)
    checkpoint = read_bert_checkpoint(folder, torch.device("cpu"), torch.float32)
    assert checkpoint is not None
    shape, tensors = checkpoint
    assert (shape.hidden_size, shape.num_hidden_layers) == (384, 6)
    ours, theirs = PackedBert(shape, tensors), PackedBert.from_model(hf_model)
    for mine, reference in zip(_packed_tensors(ours), _packed_tensors(theirs), strict=True):
        assert torch.equal(mine, reference)


def test_bert_checkpoint_leaves_what_it_cannot_read_to_transformers(
    hf_model: Any, tmp_path: Path
) -> None:
    state = dict(hf_model.state_dict())
    del state["encoder.layer.5.output.dense.bias"]
    folder = _copy_model_dir(tmp_path, state, "model.safetensors")
    assert read_bert_checkpoint(folder, torch.device("cpu"), torch.float32) is None
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "roberta"}))
    assert read_bert_checkpoint(folder, torch.device("cpu"), torch.float32) is None


def test_torch_engine_loads_a_bert_checkpoint_without_importing_transformers() -> None:
    # Importing transformers costs seconds of every worker's start; BERT models do without it.
    code = (
        "import sys; from tests.test_engines import _torch_manifest; "
        "from fabric_gpu.engines.torch_engine import TorchEngine; "
        "engine = TorchEngine(_torch_manifest(), device='cpu'); "
        "print(engine.layout, sorted(m for m in sys.modules if m.startswith('transformers')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout  # fmt: skip
    assert out.split() == ["packed", "[]"]


def _torch_manifest(dtype: str = "float32", normalize: bool = False) -> EngineManifest:
    return manifest_for_model(
        DEFAULT_MODEL_ID,
        backend="torch",
        dtype=dtype,
        profile=ConsumerProfile(2048, 16, 128, 8),
        hooks=HookSpec((2, -1), "mean", normalize=normalize),
    )


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_torch_engine_eager_forward_matches_the_reference_engine(layout: str, cpu_engine) -> None:  # type: ignore[no-untyped-def]
    from fabric_gpu.engines import PaddedBatch

    engine = TorchEngine(_torch_manifest(), device="cpu", layout=layout)
    assert engine.layout == layout
    rng = np.random.default_rng(3)
    lengths = np.array([5, 12, 3, 9])
    ids = np.zeros((4, 16), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1000, 30000, n)
    batch = PaddedBatch(ids, lengths)
    ours = engine.forward(batch)
    reference = cpu_engine.forward(batch)
    np.testing.assert_allclose(ours.pooled, reference.pooled, atol=1e-4)
    for layer in (2, -1):
        np.testing.assert_allclose(
            ours.hooks[layer].astype(np.float32),
            reference.hooks[layer].astype(np.float32),
            atol=1e-2,
        )
    # A normalising engine (the model folder's own choice) gives the same vectors at unit length.
    unit = TorchEngine(_torch_manifest(normalize=True), device="cpu", layout=layout).forward(batch)
    expected = reference.pooled / np.linalg.norm(reference.pooled, axis=1, keepdims=True)
    np.testing.assert_allclose(unit.pooled, expected, atol=1e-5)


def test_input_layout_follows_the_backend_and_architecture() -> None:
    assert input_layout(_torch_manifest()) == "packed"
    cpu = manifest_for_model(
        DEFAULT_MODEL_ID, backend="cpu", dtype="float32", profile=ConsumerProfile(2048, 16, 128, 8),
        hooks=HookSpec((), "mean"),
    )  # fmt: skip
    assert input_layout(cpu) == "padded"


def test_capture_needs_a_gpu() -> None:
    engine = TorchEngine(_torch_manifest(), device="cpu")
    with pytest.raises(EngineError, match="CUDA"):
        engine.capture([(512, 16)])


@pytest.mark.slow
def test_onnx_export_matches_the_cpu_reference(hf_model: Any, tmp_path: Path) -> None:
    import onnxruntime as ort

    from fabric_gpu.engines.onnx_export import export_onnx

    path = export_onnx(hf_model, (2, 6), "mean", tmp_path / "model.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    assert [o.name for o in session.get_outputs()] == ["pooled", "hook_0", "hook_1"]
    for batch, seq in ((3, 40), (1, 7), (5, 128)):  # dynamic axes: other shapes than the export's
        rng = np.random.default_rng(batch)
        ids = rng.integers(1000, 30000, (batch, seq))
        mask = np.ones((batch, seq), np.int64)
        mask[0, seq // 2 :] = 0
        pooled, hook2, hook6 = session.run(None, {"input_ids": ids, "attention_mask": mask})
        with torch.inference_mode():
            ref = hf_model(
                input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                output_hidden_states=True,
            )  # fmt: skip
        w = torch.from_numpy(mask)[..., None].float()
        expected = (ref.last_hidden_state * w).sum(1) / w.sum(1)
        cos = torch.nn.functional.cosine_similarity(torch.from_numpy(pooled), expected, dim=1)
        assert cos.min() > 0.9999
        real = mask.astype(bool)
        np.testing.assert_allclose(hook2[real], ref.hidden_states[2].numpy()[real], atol=1e-4)
        np.testing.assert_allclose(hook6[real], ref.hidden_states[6].numpy()[real], atol=1e-4)


@pytest.mark.skipif(
    importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here"
)
def test_tensorrt_backend_says_what_is_missing() -> None:
    from fabric_gpu.engines import create_engine

    manifest = EngineManifest.from_mapping(
        {**_torch_manifest().to_mapping(), "backend": "tensorrt"}
    )
    with pytest.raises(EngineError, match="needs NVIDIA TensorRT 10"):
        create_engine(manifest)


def test_tensorrt_profiles_are_one_per_bucket_shape() -> None:
    from fabric_gpu.engines.tensorrt_engine import optimization_profiles

    profiles = optimization_profiles([(64, 512), (8, 1024), (512, 64)])
    assert [p["input_ids"][0] for p in profiles] == [(1024, 8), (512, 64), (64, 512)]
    assert all(p["input_ids"][0] == p["input_ids"][2] == p["attention_mask"][1] for p in profiles)
    with pytest.raises(ValueError, match="empty"):
        optimization_profiles([(0, 4)])


@pytest.mark.parametrize("architecture", ["roberta", "xlm-roberta"])
def test_roberta_and_xlmr_position_offsets_match_hugging_face(architecture: str) -> None:
    """RoBERTa and XLM-R number positions from padding_idx + 1 (an offset of 2), counting only
    tokens that are not the padding id. Random weights: every item's pooled vector from the
    torch engine's padded batch equals the module run on that item alone, up to the longest
    length the position table holds (max_position_embeddings - 2)."""
    import transformers

    from fabric_gpu.engines import PaddedBatch

    config_class, model_class = {
        "roberta": (transformers.RobertaConfig, transformers.RobertaModel),
        "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel),
    }[architecture]
    torch.manual_seed(0)
    config = config_class(
        vocab_size=600, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=130, pad_token_id=1,
    )  # fmt: skip
    model = model_class(config, add_pooling_layer=False).eval()
    manifest = EngineManifest.from_mapping(
        {
            "model_id": f"random-{architecture}", "weights_sha256": "0" * 64, "backend": "torch",
            "dtype": "float32", "max_batch_tokens": 4096, "max_batch_items": 16,
            "max_seq_len": 128, "seq_granularity": 8, "hooks": HookSpec((), "mean").to_mapping(),
        }
    )  # fmt: skip
    engine = TorchEngine(manifest, model=model, device="cpu", layout="padded")
    rng = np.random.default_rng(4)
    lengths = np.array([128, 1, 37, 127, 5, 64])
    ids = np.zeros((len(lengths), 128), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(3, 600, n)
    ours = engine.forward(PaddedBatch(ids, lengths)).pooled
    for i, n in enumerate(lengths):
        with torch.inference_mode():
            alone = model(input_ids=torch.from_numpy(ids[i : i + 1, :n])).last_hidden_state
        np.testing.assert_allclose(ours[i], alone[0].mean(0).numpy(), atol=2e-5, rtol=1e-4)
    # The offset matters: positions from 0 instead would give other vectors.
    with torch.inference_mode():
        wrong = (
            model(input_ids=torch.from_numpy(ids[2:3, :37]), position_ids=torch.arange(37)[None])
            .last_hidden_state[0]
            .mean(0)
        )
    assert not np.allclose(ours[2], wrong.numpy(), atol=1e-3)
