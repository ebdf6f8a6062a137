"""Consumer profiles and engine manifests refuse what they cannot trust, naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fabric_gpu.manifest import REQUIRED_FIELDS, EngineManifest, ManifestError
from fabric_gpu.profile import ConsumerProfile, ProfileError


@pytest.mark.parametrize(
    ("numbers", "field"),
    [
        ((256, 64, 512, 8), "max_batch_tokens"),  # smaller than max_seq_len
        ((4096, 0, 512, 8), "max_batch_items"),
        ((4096, 64, 512, 0), "seq_granularity"),
        ((4096, 64, 0, 8), "max_seq_len"),
        ((4096, 64, 100, 8), "seq_granularity"),  # 100 is not a multiple of 8
        ((4096.0, 64, 512, 8), "max_batch_tokens"),
    ],
)
def test_inconsistent_profiles_name_the_field(numbers: tuple, field: str) -> None:
    with pytest.raises(ProfileError, match=field):
        ConsumerProfile(*numbers)


def test_bucket_length_rounds_up_to_the_granularity() -> None:
    p = ConsumerProfile(4096, 64, 512, 8)
    assert [p.bucket_length(n) for n in (1, 7, 8, 9, 512)] == [8, 8, 8, 16, 512]


def _valid() -> dict:
    return {
        "model_id": "sentence-transformers/all-MiniLM-L6-v2",
        "weights_sha256": "a" * 64,
        "backend": "cpu",
        "dtype": "float32",
        "max_batch_tokens": 4096,
        "max_batch_items": 64,
        "max_seq_len": 128,
        "seq_granularity": 8,
        "hooks": {"layers": [2, -1], "pooling": "mean"},
    }


def test_a_complete_manifest_round_trips() -> None:
    m = EngineManifest.from_mapping(_valid())
    assert EngineManifest.from_mapping(m.to_mapping()) == m
    assert len(REQUIRED_FIELDS) == 9
    # all-MiniLM-L6-v2's folder has a Normalize module: a manifest that does not say takes it.
    assert m.hooks.normalize is True
    assert m.model_key == "all-MiniLM-L6-v2@aaaaaaaaaaaa:mean+normalized"


def test_a_manifest_can_turn_the_models_normalisation_off_and_must_say_it_plainly() -> None:
    data = _valid()
    data["hooks"] = {"layers": [], "pooling": "mean", "normalize": False}
    m = EngineManifest.from_mapping(data)
    assert m.hooks.normalize is False and m.model_key == "all-MiniLM-L6-v2@aaaaaaaaaaaa:mean"
    data["hooks"] = {"layers": [], "pooling": "mean", "normalize": "yes"}
    with pytest.raises(ManifestError, match=r"hooks\.normalize must be true or false"):
        EngineManifest.from_mapping(data)
    data["hooks"] = {"layers": [], "pooling": "mean", "normalise": True}
    with pytest.raises(ManifestError, match="field hooks must be a mapping"):
        EngineManifest.from_mapping(data)


@pytest.mark.parametrize("field", REQUIRED_FIELDS)
def test_every_field_is_required(field: str) -> None:
    data = _valid()
    del data[field]
    with pytest.raises(ManifestError, match=f"missing required field.*{field}"):
        EngineManifest.from_mapping(data)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("backend", "onnx"),
        ("dtype", "int8"),
        ("weights_sha256", "abc"),
        ("max_batch_items", "64"),
        ("hooks", {"layers": [1], "pooling": "max"}),
        ("hooks", {"layers": ["1"], "pooling": "mean"}),
        ("hooks", {"layers": [1, 1], "pooling": "mean"}),
        ("hooks", [1, 2]),
    ],
)
def test_mistyped_fields_are_named(field: str, value: object) -> None:
    data = _valid()
    data[field] = value
    with pytest.raises(ManifestError, match=field):
        EngineManifest.from_mapping(data)


def test_unknown_fields_are_refused(tmp_path: Path) -> None:
    data = _valid() | {"batch_size": 32}
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"engine.json: unknown field\(s\) batch_size"):
        EngineManifest.load(path)


def test_a_wrong_weights_hash_is_refused_by_the_engine() -> None:
    from fabric_gpu.engines import create_engine

    with pytest.raises(ManifestError, match=r"weights_sha256.*hash to"):
        create_engine(EngineManifest.from_mapping(_valid()))
