"""A task set's prompt: its vectors are exactly those of its texts with the prompt written in by
hand; the prompt is part of the set, recorded, and chosen by name from the model's config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import Engine

from fabric_gpu.encoding import encode
from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.tasks.catalog import ImmutableTaskSetError, get_task_set, ingest_task_set
from fabric_pipelines.lib.tasks.prompts import (
    PromptError,
    chosen_prompt,
    record_prompt,
    set_prompt,
)
from tests.pipeline_helpers import run_stages, stored_embeddings

TEXTS = [
    "How do I open a file for reading?",
    "Return the number of items in a container.",
    "pinned memory and a doorbell",
    "What is the capital of France?",
] * 3


def _source(tmp_path: Path, name: str, texts: list[str]) -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    return path


@pytest.mark.slow
def test_a_prompt_gives_the_vectors_of_the_prompt_written_in_by_hand(
    db: Engine, paths: FabricPaths, tmp_path: Path, cpu_engine, manifest: EngineManifest
) -> None:
    record_prompt(paths.inbox, "prompted", "query: ")
    prompt = set_prompt(paths.inbox, "prompted", manifest.model_id)
    assert prompt == "query: "
    run_stages(
        db, paths, cpu_engine, manifest, _source(tmp_path, "a", TEXTS), "prompted", prompt=prompt
    )
    by_hand = [f"query: {t}" for t in TEXTS]
    run_stages(db, paths, cpu_engine, manifest, _source(tmp_path, "b", by_hand), "by-hand")
    prompted = stored_embeddings(db, "prompted", manifest.model_key)
    written = stored_embeddings(db, "by-hand", manifest.model_key)
    plain = encode(TEXTS, manifest, engine=cpu_engine).vectors
    for i in range(len(TEXTS)):
        assert np.array_equal(prompted[f"t{i}"], written[f"t{i}"]), f"item {i}"
        assert not np.allclose(prompted[f"t{i}"], plain[i]), "the prompt changed the vector"
    assert get_task_set(db, "prompted").prompt == "query: "
    assert get_task_set(db, "by-hand").prompt == ""
    # encode() takes the same path: its prompt gives the same vectors.
    encoded = encode(TEXTS, manifest, prompt="query: ", engine=cpu_engine).vectors
    assert np.array_equal(encoded, np.stack([prompted[f"t{i}"] for i in range(len(TEXTS))]))


def test_a_set_tokenised_with_one_prompt_refuses_another(
    db: Engine, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest
) -> None:
    from fabric_pipelines.lib.tasks.inbox import submit

    submit(_source(tmp_path, "s", TEXTS), paths.inbox, "s")
    first = ingest_task_set(
        db, paths, "s", model_id=manifest.model_id, max_seq_len=128, prompt="query: "
    )
    assert first.prompt == "query: "
    again = ingest_task_set(
        db, paths, "s", model_id=manifest.model_id, max_seq_len=128, prompt="query: "
    )
    assert again.reused and again.content_sha256 == first.content_sha256
    with pytest.raises(ImmutableTaskSetError, match=r"prompt 'query: ', not 'passage: '.*new name"):
        ingest_task_set(
            db, paths, "s", model_id=manifest.model_id, max_seq_len=128, prompt="passage: "
        )


def test_a_prompt_name_must_be_one_the_model_defines(manifest: EngineManifest) -> None:
    assert chosen_prompt(manifest.model_id, "query: ", None) == "query: "
    assert chosen_prompt(manifest.model_id, None, None) is None
    with pytest.raises(PromptError, match=r"no prompt named 'query' \(its prompts: none\)"):
        chosen_prompt(manifest.model_id, None, "query")
    with pytest.raises(PromptError, match="not both"):
        chosen_prompt(manifest.model_id, "query: ", "query")


def test_a_prompt_is_refused_for_a_model_that_pools_without_its_tokens(tmp_path: Path) -> None:
    """include_prompt false (encode() leaves the prompt's tokens out of the pooled vector) is not
    computed by the engines: a prompt for such a model is refused at submit and at ingest, by
    text, by name and as the model's default, naming the field; no prompt is fine."""
    import shutil

    from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_dir(DEFAULT_MODEL_ID), folder)
    pooling = folder / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "include_prompt": False}))
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: "}, "default_prompt_name": "query"})
    )
    model = str(folder)
    refused = r"include_prompt false.*without a prompt \(it would be 'query: '\)"
    with pytest.raises(PromptError, match=refused):
        chosen_prompt(model, "query: ", None)
    with pytest.raises(PromptError, match=refused):
        chosen_prompt(model, None, "query")
    assert chosen_prompt(model, "", None) == ""  # an empty prompt is no prompt
    inbox = tmp_path / "inbox"
    with pytest.raises(PromptError, match=refused):
        set_prompt(inbox, "s", model)  # the model's default prompt, at ingest
    record_prompt(inbox, "s", "query: ")
    with pytest.raises(PromptError, match=refused):
        set_prompt(inbox, "s", model)
    record_prompt(inbox, "t", "")
    assert set_prompt(inbox, "t", model) == ""
