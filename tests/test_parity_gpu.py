"""Parity with `SentenceTransformer.encode` at its defaults on the torch engine on the GPU, with
the real all-MiniLM-L6-v2 and all-mpnet-base-v2 weights: the same check as the CPU engine's
(tests/test_parity.py), vectors read back with `fabric export`, for `truncate` and `chunk`.

The GPU machine has no network, so the weights travel there with `scripts/weights-for-device`
(bench/README.md says how). Marked `gpu`; skipped with the reason where there is no GPU or the
model package is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fabric_gpu import probe_gpu
from fabric_gpu.model import ModelNotFoundError, resolve_model_dir
from fabric_pipelines.lib.core.settings import FabricPaths
from tests.test_parity import LONG_INPUTS, MODELS, check_encode_parity

STATUS = probe_gpu()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not (STATUS.available and torch.cuda.is_available()),
        reason="no GPU: " + (STATUS.reason or "torch sees no CUDA device"),
    ),
]


@LONG_INPUTS
@MODELS
def test_the_torch_engine_gives_encode_at_its_defaults_with_the_real_weights(
    paths: FabricPaths,
    tmp_path: Path,
    model_id: str,
    max_seq_len: int,
    every: int,
    long_inputs: str,
) -> None:
    """float16 (the torch engine's packed attention is half precision) to the CPU engine's
    float32 bound: cosine >= 0.9999 for every item (the lowest is printed)."""
    try:
        resolve_model_dir(model_id)
    except ModelNotFoundError as exc:
        pytest.skip(f"the real weights are not installed here: {exc}")
    lowest = check_encode_parity(
        paths, tmp_path, model_id, max_seq_len, every, long_inputs, "torch", "float16"
    )
    print(f"{model_id} {long_inputs} torch float16: lowest cosine {lowest:.7f}")
