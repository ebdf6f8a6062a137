"""Tokenising text for ingest: the product's path against the tokenizer itself, same texts, same run.

The texts are bench/e2e.py's: vocabulary words whose token counts follow the yardstick's
`reference_lengths()`. Ours is `fabric_gpu.tokenise.encode_texts` (the native WordPiece encoder on every core,
fabric_gpu/wordpiece.py, the reference tokenizer for what it hands back); the peer is the same
function's reference path (Hugging Face `tokenizers` encode_batch on every core, its ids turned
into arrays). Both must give the same ids; the bench checks that before it prints.

    python bench/tokenise.py --tasks 200000 [--tokenizer DIR]

Last line: one JSON object {tasks, tokens, ours_tokens_per_s, reference_tokens_per_s, ratio}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import vocabulary_words, write_texts
from yardstick import DEFAULT, load_reference

from fabric_gpu import tokenise
from fabric_gpu.model import DEFAULT_MODEL_ID, load_tokenizer, resolve_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=200_000)
    parser.add_argument("--reference", default=str(DEFAULT))
    parser.add_argument("--tokenizer", help="folder with a tokenizer.json (default: all-MiniLM)")
    args = parser.parse_args()

    folder = Path(args.tokenizer) if args.tokenizer else resolve_model_dir(DEFAULT_MODEL_ID)
    tokenizer = load_tokenizer(folder)
    lengths = np.asarray(load_reference(args.reference).reference_lengths(args.tasks, max_len=512))
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "texts.parquet"
        write_texts(path, lengths, vocabulary_words(folder))
        texts = pq.read_table(path).column("text").combine_chunks()

    start = time.perf_counter()
    ours_lengths, ours_tokens, _ = tokenise.encode_texts(tokenizer, texts)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    ref_lengths, ref_tokens, _ = tokenise._encode_reference(tokenizer, texts, None)
    reference_s = time.perf_counter() - start
    if not (np.array_equal(ours_lengths, ref_lengths) and np.array_equal(ours_tokens, ref_tokens)):
        sys.exit("tokenise: the two paths gave different ids")

    tokens = int(ref_lengths.sum())
    result = {
        "tasks": args.tasks,
        "tokens": tokens,
        "cores": len(os.sched_getaffinity(0)),
        "ours_tokens_per_s": round(tokens / ours_s),
        "reference_tokens_per_s": round(tokens / reference_s),
        "ratio": round(reference_s / ours_s, 2),
    }
    print(
        f"{args.tasks:,} texts, {tokens:,} tokens on {result['cores']} cores: "
        f"ours {ours_s:.2f} s ({tokens / ours_s / 1e6:.1f} M tok/s), "
        f"reference {reference_s:.2f} s ({tokens / reference_s / 1e6:.2f} M tok/s): "
        f"{result['ratio']}x"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
