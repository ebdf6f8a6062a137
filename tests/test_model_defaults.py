"""A model folder's own defaults (sentence-transformers files), read as encode() reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir
from fabric_gpu.model_defaults import ModelDefaultsError, model_defaults


def test_all_minilm_says_256_tokens_mean_pooling_and_unit_vectors() -> None:
    found = model_defaults(resolve_model_dir(DEFAULT_MODEL_ID))
    assert (found.max_seq_len, found.pooling, found.normalize) == (256, "mean", True)
    assert found.do_lower_case is False and found.prompts == {}
    assert found.include_prompt is True  # its pooling config does not set it: the default


def _folder(tmp_path: Path, files: dict[str, object]) -> Path:
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return tmp_path


def test_a_plain_hugging_face_folder_gets_mean_pooling_and_its_position_limit(
    tmp_path: Path,
) -> None:
    folder = _folder(
        tmp_path, {"config.json": {"model_type": "bert", "max_position_embeddings": 384}}
    )
    found = model_defaults(folder)
    assert (found.max_seq_len, found.pooling, found.normalize) == (384, "mean", False)
    roberta = _folder(
        tmp_path / "r", {"config.json": {"model_type": "roberta", "max_position_embeddings": 514}}
    )
    assert model_defaults(roberta).max_seq_len == 512  # 514 positions, 2 before the first token


def test_cls_pooling_prompts_and_lower_casing_are_read(tmp_path: Path) -> None:
    folder = _folder(
        tmp_path,
        {
            "config.json": {"max_position_embeddings": 512},
            "sentence_bert_config.json": {"max_seq_length": 128, "do_lower_case": True},
            "modules.json": [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ],
            "1_Pooling/config.json": {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False, "include_prompt": False},
            "config_sentence_transformers.json": {
                "prompts": {"query": "query: ", "passage": "passage: "},
                "default_prompt_name": "query",
            },
        },
    )  # fmt: skip
    found = model_defaults(folder)
    assert (found.max_seq_len, found.pooling, found.normalize) == (128, "cls", False)
    assert found.do_lower_case is True
    assert found.prompts == {"query": "query: ", "passage": "passage: "}
    assert found.default_prompt_name == "query"
    assert found.include_prompt is False
    assert found.prompt_pooling_error("", "m") is None
    assert "include_prompt false" in (found.prompt_pooling_error("query: ", "m") or "")


def test_a_pooling_the_engines_do_not_compute_is_refused_only_where_it_is_needed(
    tmp_path: Path,
) -> None:
    folder = _folder(
        tmp_path,
        {
            "modules.json": [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}],
            "1_Pooling/config.json": {"pooling_mode_max_tokens": True},
        },
    )
    found = model_defaults(folder)  # the rest of the folder's defaults still read
    assert found.pooling is None and found.normalize is False
    with pytest.raises(ModelDefaultsError, match=r"pooling_mode_max_tokens.*set the pooling"):
        found.default_pooling()
