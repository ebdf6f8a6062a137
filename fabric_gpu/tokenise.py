"""Text to token ids, many texts at once: the path every text takes, in ingest and in
`fabric_gpu.encode` alike.

A BERT WordPiece tokenizer's ASCII texts are encoded natively on every core (wordpiece.py);
the tokenizer itself (Rust, `encode_batch`) encodes the rest and says which texts it refuses.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Encoding, Tokenizer
from tqdm import tqdm

from fabric_gpu.wordpiece import NativeWordPiece, merge_handed_back

if TYPE_CHECKING:
    import pyarrow as pa

# Texts per encode_batch call: large enough to keep every core busy between calls, small enough
# that a chunk's Encoding objects (a few kB per text) stay well under a GB.
TOKENISE_CHUNK = 8192


def encode_texts(
    tokenizer: Tokenizer, texts: Sequence[str] | pa.Array, *, progress: bool = False
) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """(tokens per text, all tokens back to back, why the tokenizer refused a text, by index),
    special tokens added; a refused text has no tokens. `texts`: a list or an Arrow string array.

    A BERT WordPiece tokenizer's ASCII texts are encoded natively on every core (same ids,
    fabric_gpu/wordpiece.py); the tokenizer itself encodes the rest.
    """
    bar = tqdm(total=len(texts), desc="tokenise", unit="item", disable=not progress)
    native = NativeWordPiece.of(tokenizer)
    found = None if native is None else native.encode(texts, on_progress=bar.update)
    if found is None:
        bar.reset()
        encoded = _encode_reference(tokenizer, texts, bar)
        bar.close()
        return encoded
    lengths, tokens = found
    back = np.flatnonzero(lengths < 0)
    refused: dict[int, str] = {}
    if len(back):
        chosen = texts.take(back) if hasattr(texts, "take") else [texts[i] for i in back.tolist()]
        back_lengths, back_tokens, back_refused = _encode_reference(tokenizer, chosen, None)
        refused = {int(back[i]): reason for i, reason in back_refused.items()}
        lengths, tokens = merge_handed_back(lengths, tokens, back, back_lengths, back_tokens)
    bar.close()
    return lengths, tokens, refused


def _encode_reference(
    tokenizer: Tokenizer, texts: Sequence[str] | pa.Array, bar: tqdm | None
) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """encode_texts through the tokenizer itself.

    encode_batch runs in Rust on every core without the GIL. Turning its Encodings into ids
    needs Python, a few microseconds per text, so this thread does that for one chunk while
    encode_batch encodes the next.
    """
    lengths: list[np.ndarray] = []
    tokens: list[np.ndarray] = []
    refused: dict[int, str] = {}
    pending: deque[tuple[int, list[str], Future[list[Encoding]]]] = deque()

    def collect() -> None:
        start, chunk, encoding = pending.popleft()
        chunk_lengths, chunk_tokens = _flat_ids(tokenizer, start, chunk, encoding, refused)
        lengths.append(chunk_lengths)
        tokens.append(chunk_tokens)
        if bar is not None:
            bar.update(len(chunk))

    with ThreadPoolExecutor(1, thread_name_prefix="encode") as encoder:
        for start in range(0, len(texts), TOKENISE_CHUNK):
            chunk = _list(texts[start : start + TOKENISE_CHUNK])
            pending.append((start, chunk, encoder.submit(_encode_batch, tokenizer, chunk)))
            if len(pending) > 1:
                collect()
        while pending:
            collect()
    if not tokens:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32), refused
    return np.concatenate(lengths), np.concatenate(tokens), refused


def _encode_batch(tokenizer: Tokenizer, texts: list[str]) -> list[Encoding]:
    # The _fast variant leaves out character offsets, which ingest does not keep.
    return tokenizer.encode_batch_fast(texts, add_special_tokens=True)


def _flat_ids(
    tokenizer: Tokenizer,
    start: int,
    texts: list[str],
    encoding: Future[list[Encoding]],
    refused: dict[int, str],
) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's ids back to back (its first text is text `start`); if the tokenizer refused the
    chunk, it encodes the texts one by one to find the ones it refuses."""
    try:
        ids = [e.ids for e in encoding.result()]
    except Exception:
        ids = []
        for i, text in enumerate(texts, start=start):
            try:
                ids.append(tokenizer.encode(text, add_special_tokens=True).ids)
            except Exception as exc:
                ids.append([])
                refused[i] = (
                    f"'text' could not be tokenised ({type(exc).__name__}: {exc}); check it"
                )
    # One pass over all ids of the chunk: cheaper than an array per text and a concatenation.
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    return lengths, flat


def _list(texts: Sequence[str] | pa.Array) -> list[str]:
    return texts.to_pylist() if hasattr(texts, "to_pylist") else list(texts)
