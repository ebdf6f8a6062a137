"""The output variants' torch twin on the GPU equals the NumPy twin (exactly for int8 and binary,
within 1e-3 for float16). Marked `gpu`; skipped with the reason where no GPU is present."""

from __future__ import annotations

import pytest
import torch

from fabric_gpu import probe_gpu
from fabric_gpu.variants import Variant
from tests.test_variants import VARIANTS, assert_twins_agree, vectors

STATUS = probe_gpu()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (STATUS.available and torch.cuda.is_available()),
        reason="no GPU: " + (STATUS.reason or "torch sees no CUDA device"),
    ),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.label)
def test_the_gpu_twin_equals_the_numpy_twin(variant: Variant) -> None:
    for seed, dim in ((0, 384), (1, 768), (2, 1024)):
        assert_twins_agree(variant, vectors(4096, dim, seed), "cuda")
