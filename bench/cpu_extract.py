"""CPU extraction: the pipeline's CPU engine path against sentence-transformers, same run.

Both sides embed the same standard-library docstrings with the real all-MiniLM-L6-v2 in fp32 on
the CPU, tokenisation included on both sides:
  - ours: fast tokenizer, shape-bucketed batches from the planner, gather into padded arrays,
    the CPU engine's forward with mean pooling (no hook layers, no database: the compute path);
  - peer: SentenceTransformer.encode(texts, batch_size=32), its default.
Prints real tokens/s of each and the ratio; the last line is one JSON object.

    .venv/bin/python bench/cpu_extract.py [--items 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from fabric_gpu.batching import plan_batches
from fabric_gpu.engines import create_engine
from fabric_gpu.engines.base import gather_padded
from fabric_gpu.manifest import HookSpec, manifest_for_model
from fabric_gpu.model import DEFAULT_MODEL_ID, load_tokenizer, resolve_model_dir
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.cli.demo_corpus import stdlib_docstrings

MAX_SEQ_LEN = 512


def ours(texts: list[str], engine, tokenizer, profile: ConsumerProfile) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    encodings = tokenizer.encode_batch(texts)
    lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in encodings])
    plan = plan_batches(lengths, profile)
    for b in range(plan.n_batches):
        rows = plan.order[plan.item_start[b] : plan.item_start[b] + plan.item_count[b]]
        engine.forward(gather_padded(tokens, offsets, rows, int(plan.seq_len[b]), 0))
    return time.perf_counter() - start, int(lengths.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=1000)
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    model_dir = resolve_model_dir(DEFAULT_MODEL_ID)
    tokenizer = load_tokenizer(model_dir)
    texts = [t for _, t in stdlib_docstrings(args.items * 2)]
    texts = [t for t in texts if len(tokenizer.encode(t).ids) <= MAX_SEQ_LEN][: args.items]
    profile = ConsumerProfile(8192, 256, MAX_SEQ_LEN, 8)
    manifest = manifest_for_model(
        DEFAULT_MODEL_ID,
        backend="cpu",
        dtype="float32",
        profile=profile,
        hooks=HookSpec((), "mean"),
    )
    engine = create_engine(manifest)
    peer = SentenceTransformer(str(model_dir), device="cpu")
    peer.max_seq_length = MAX_SEQ_LEN

    ours(texts[:64], engine, tokenizer, profile)  # warm-up
    peer.encode(texts[:64], batch_size=32)
    ours_s, real_tokens = min(ours(texts, engine, tokenizer, profile) for _ in range(2))
    peer_s = 1e9
    for _ in range(2):
        start = time.perf_counter()
        peer.encode(texts, batch_size=32)
        peer_s = min(peer_s, time.perf_counter() - start)

    result = {
        "items": len(texts),
        "real_tokens": real_tokens,
        "torch_threads": torch.get_num_threads(),
        "ours_tokens_per_s": round(real_tokens / ours_s, 1),
        "sentence_transformers_tokens_per_s": round(real_tokens / peer_s, 1),
        "ratio_vs_sentence_transformers": round(peer_s / ours_s, 3),
    }
    print(
        f"items {len(texts)}, real tokens {real_tokens:,}, torch threads {result['torch_threads']}"
    )
    print(
        f"ours (bucketed batches, CPU engine)   {result['ours_tokens_per_s']:>12,.0f} real tokens/s"
    )
    print(
        f"sentence-transformers encode(bs=32)   {result['sentence_transformers_tokens_per_s']:>12,.0f} real tokens/s"
    )
    print(
        f"ratio                                 {result['ratio_vs_sentence_transformers']:>12.2f}x"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
