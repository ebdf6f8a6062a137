"""fabric_gpu.encode: the pipeline's path from tokens to vectors in one call, on the real model
(all-MiniLM-L6-v2 on the CPU engine)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine

import fabric_gpu
from fabric_gpu.encoding import EncodeError, encode
from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.results.export import export_task_set
from tests.pipeline_helpers import run_stages, stored_embeddings

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return the number of items in a container.",
    "hello",
    "Open a file and return a stream; raise OSError upon failure.",
    "A much longer sentence that goes on for a while, describing in some detail how a ring "
    "buffer of pinned memory hands batches to a GPU without any host thread in the way.",
] * 5 + [f"item number {i} of a list of short texts" for i in range(20)]


@pytest.mark.slow
def test_encode_gives_the_pipelines_vectors_and_hidden_states_bit_for_bit(
    db: Engine, paths: FabricPaths, tmp_path: Path, cpu_engine, manifest: EngineManifest
) -> None:
    source = tmp_path / "set.jsonl"
    source.write_text(
        "".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS))
    )
    run_stages(db, paths, cpu_engine, manifest, source, "same-path")
    stored = stored_embeddings(db, "same-path", manifest.model_key)
    # The hidden states as the product hands them out: a repeated text's are its first's, read
    # from that task's shard file (reuse by reference).
    exported = pq.read_table(
        export_task_set(db, "same-path", tmp_path / "states.parquet", layers=[2, -1]).path
    )
    hidden = {
        task_id: {
            layer: np.asarray(exported.column(f"layer_{layer}")[row].as_py(), dtype=np.float16)
            for layer in (2, -1)
        }
        for row, task_id in enumerate(exported.column("id").to_pylist())
    }

    encoded = fabric_gpu.encode(TEXTS, manifest, engine=cpu_engine)

    assert encoded.vectors.shape == (len(TEXTS), 384)
    for i in range(len(TEXTS)):
        assert np.array_equal(encoded.vectors[i], stored[f"t{i}"]), f"vector of item {i}"
        for layer in (2, -1):
            assert np.array_equal(encoded.hidden_state(layer, i), hidden[f"t{i}"][layer]), (
                f"layer {layer} of item {i}"
            )


def test_texts_and_their_token_ids_encode_alike(cpu_engine, manifest: EngineManifest) -> None:
    from fabric_gpu.model import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(manifest.model_id))
    ids = [tokenizer.encode(t).ids for t in TEXTS[:7]]
    by_text = encode(TEXTS[:7], manifest, engine=cpu_engine)
    by_ids = encode(ids, manifest, engine=cpu_engine)
    assert np.array_equal(by_text.vectors, by_ids.vectors)
    assert np.array_equal(by_text.tokens, np.concatenate(ids))
    # The vectors are the model's: mean pooling of the last layer, item by item.
    norms = np.linalg.norm(by_text.vectors, axis=1)
    assert (norms > 0).all() and not np.allclose(by_text.vectors[0], by_text.vectors[1])


def test_hooks_choose_the_layers_returned(manifest: EngineManifest) -> None:
    encoded = encode(TEXTS[:3], manifest, hooks=[1])
    assert set(encoded.hidden_states) == {1}
    assert encoded.hidden_state(1, 2).shape == (int(np.diff(encoded.offsets)[2]), 384)


def test_bad_inputs_are_refused_naming_the_input(cpu_engine, manifest: EngineManifest) -> None:
    with pytest.raises(EncodeError, match="no inputs"):
        encode([], manifest, engine=cpu_engine)
    with pytest.raises(EncodeError, match="mix texts and token-id lists"):
        encode(["a", [101, 102]], manifest, engine=cpu_engine)  # type: ignore[list-item]
    with pytest.raises(EncodeError, match="input 1 has no tokens"):
        encode([[101, 102], []], manifest, engine=cpu_engine)
    too_long = [101] + [1000] * manifest.profile.max_seq_len + [102]
    with pytest.raises(EncodeError, match=r"input 2 has 130 tokens, more than .* max_seq_len 128"):
        encode([[101, 102], [101, 102], too_long], manifest, engine=cpu_engine)
    with pytest.raises(EncodeError, match="another manifest"):
        encode(["a"], manifest, hooks=[0], engine=cpu_engine)
