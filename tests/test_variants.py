"""Output variants (fabric_gpu/variants.py): the torch twin equals the NumPy twin (exactly for
int8 and binary, within 1e-3 for float16), Matryoshka truncation renormalises, int8 follows its
recorded calibration, and every encoding takes the bytes it says. The GPU run of the torch twin
is tests/test_variants_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fabric_gpu.variants import Int8Calibration, Variant, VariantError, decode

VARIANTS = [
    Variant("float32"),
    Variant("float16"),
    Variant("float16", 128, normalize=True),
    Variant("int8"),
    Variant("int8", 64, normalize=True),
    Variant("binary"),
    Variant("binary", 100, normalize=True),
]


def vectors(rows: int = 2000, dim: int = 384, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dim)).astype(np.float32) * rng.uniform(0.1, 3, dim).astype(
        np.float32
    )
    x[:5] = 0.0  # zero rows and exact zeros: the sign bit and the norm's floor
    return x


def assert_twins_agree(variant: Variant, x: np.ndarray, device: str) -> None:
    calibration = (
        Int8Calibration.of(variant.prepared(x[:500])) if variant.needs_calibration() else None
    )
    cpu = variant.apply_numpy(x, calibration)
    other = variant.apply_torch(torch.from_numpy(x).to(device), calibration).cpu().numpy()
    assert other.dtype == cpu.dtype and other.shape == cpu.shape
    if variant.encoding in ("int8", "binary"):
        assert np.array_equal(other, cpu), (
            f"{variant.label}: {np.count_nonzero(other != cpu)} differ"
        )
    else:
        np.testing.assert_allclose(other.astype(np.float32), cpu.astype(np.float32), atol=1e-3)
    assert cpu.nbytes == len(x) * variant.row_bytes(x.shape[1])


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.label)
def test_the_torch_twin_equals_the_numpy_twin_on_the_cpu(variant: Variant) -> None:
    assert_twins_agree(variant, vectors(), "cpu")


def test_matryoshka_truncates_then_renormalises() -> None:
    x = vectors()
    short = Variant("float32", 64, normalize=True).apply_numpy(x)
    assert short.shape == (len(x), 64)
    norms = np.linalg.norm(short[5:], axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-6)
    expected = x[5:, :64] / np.linalg.norm(x[5:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(short[5:], expected, atol=1e-6)


def test_binary_is_the_sign_bit_first_dimension_high() -> None:
    x = np.array([[1.0, -1.0, 0.0, 2.0, -3.0, 0.5, 0.5, -0.1, 7.0]], dtype=np.float32)
    packed = Variant("binary").apply_numpy(x)
    assert packed.tolist() == [[0b10010110, 0b10000000]]


def test_int8_spans_its_calibration_and_decodes_near_the_value() -> None:
    x = vectors()
    variant = Variant("int8")
    calibration = Int8Calibration.of(x)
    q = variant.apply_numpy(x, calibration)
    assert q.min() == -128 and q.max() == 127
    back = decode(q, variant, calibration)
    assert np.all(np.abs(back - x) <= calibration.steps() * 1.001 + 1e-6), "within one step"
    again = Int8Calibration.from_json(calibration.to_json())
    assert np.array_equal(variant.apply_numpy(x, again), q), "the recorded calibration is exact"


def test_bad_variants_are_refused_naming_the_field() -> None:
    with pytest.raises(VariantError, match="encoding is one of"):
        Variant.parse("int4")
    with pytest.raises(VariantError, match="dims after ':'"):
        Variant.parse("int8:abc")
    with pytest.raises(VariantError, match="dims 1000 > the model's 384"):
        Variant.parse("float16:1000").apply_numpy(vectors(3))
    with pytest.raises(VariantError, match="int8 needs a calibration"):
        Variant("int8").apply_numpy(vectors(3))
    assert Variant.parse("binary:256", normalize=True) == Variant("binary", 256, True)
    assert [Variant.parse(v).row_bytes(384) for v in ("float32", "float16", "int8", "binary")] == [
        1536,
        768,
        384,
        48,
    ]
