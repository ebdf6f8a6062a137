"""The output variants' torch twin on the GPU equals the NumPy twin (exactly for int8 and binary,
within 1e-3 for float16). Marked `gpu`; skipped with the reason where no GPU is present."""

from __future__ import annotations

import pytest

from fabric_gpu.variants import Variant
from tests.gpu_marks import TORCH_GPU
from tests.test_variants import VARIANTS, assert_twins_agree, vectors

pytestmark = TORCH_GPU


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.label)
def test_the_gpu_twin_equals_the_numpy_twin(variant: Variant) -> None:
    for seed, dim in ((0, 384), (1, 768), (2, 1024)):
        assert_twins_agree(variant, vectors(4096, dim, seed), "cuda")
