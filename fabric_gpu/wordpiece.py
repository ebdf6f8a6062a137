"""BERT WordPiece on every core for ASCII text: the ids Hugging Face `tokenizers` gives, faster.

Most embedding models (MiniLM, BGE, E5, GTE, BERT itself) tokenise with a BertNormalizer, a
BertPreTokenizer and a WordPiece model. For text that is plain ASCII, that pipeline is a few
byte rules and greedy lookups, which the C++ encoder (csrc/wordpiece.cpp) runs on every core
and writes straight into NumPy arrays: no Python object per text or per id. The reference
tokenizer keeps everything else: a text holding any non-ASCII byte or one of the tokenizer's
added tokens ("[MASK]") is handed back to it, and a tokenizer of any other shape is not taken
at all (`NativeWordPiece.of` says None).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# Texts per call into the encoder: a progress update each, and a bound on the memory a call holds.
TEXTS_PER_CALL = 1 << 16


class NativeWordPiece:
    """The C++ encoder built from a tokenizer's own configuration."""

    def __init__(self, encoder: Any) -> None:
        self._encoder = encoder

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> NativeWordPiece | None:
        """The native encoder for `tokenizer`, or None where it would not give the same ids."""
        import tokenizers

        # A wrapper (or a stand-in) is its own reference: only a real Tokenizer's JSON says enough.
        if not isinstance(tokenizer, tokenizers.Tokenizer):
            return None
        config = json.loads(tokenizer.to_str())
        settings = _supported(config)
        if settings is None:
            return None
        try:
            from fabric_gpu import _wordpiece
        except ImportError as exc:  # an install built before the module: same ids, slower
            log.warning("native WordPiece unavailable (%s); the tokenizer encodes every text", exc)
            return None
        return cls(_wordpiece.Encoder(**settings))

    def encode(
        self, texts: Sequence[str] | pa.Array, on_progress: Callable[[int], object] | None = None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(tokens per text, all tokens back to back); a text's length is -1 where the reference
        tokenizer must encode it (its tokens are then absent). None if the texts cannot be read
        as UTF-8 strings (a lone surrogate): the reference tokenizer takes them all."""
        strings = _large_strings(texts)
        if strings is None:
            return None
        offsets, data = strings
        threads = len(os.sched_getaffinity(0))
        lengths: list[np.ndarray] = []
        tokens: list[np.ndarray] = []
        n = len(offsets) - 1
        for start in range(0, n, TEXTS_PER_CALL):
            stop = min(n, start + TEXTS_PER_CALL)
            part_lengths, part_tokens = self._encoder.encode(
                offsets[start : stop + 1], data, threads
            )
            lengths.append(part_lengths)
            tokens.append(part_tokens)
            if on_progress is not None:
                on_progress(stop - start)
        if not lengths:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        return np.concatenate(lengths), np.concatenate(tokens)


def merge_handed_back(
    lengths: np.ndarray,
    tokens: np.ndarray,
    back: np.ndarray,
    back_lengths: np.ndarray,
    back_tokens: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The native result with the texts at positions `back` filled in by the reference tokenizer
    (their lengths and tokens back to back, in `back`'s order), as one result in text order."""
    merged = lengths.copy()
    merged[back] = back_lengths
    starts = np.cumsum(merged) - merged
    out = np.empty(int(merged.sum()), dtype=np.int32)
    native = np.flatnonzero(lengths >= 0)
    for rows, part_lengths, part in (
        (native, lengths[native], tokens),
        (back, back_lengths, back_tokens),
    ):
        part_starts = np.cumsum(part_lengths) - part_lengths
        out[np.repeat(starts[rows] - part_starts, part_lengths) + np.arange(len(part))] = part
    return merged, out


def _supported(config: dict[str, Any]) -> dict[str, Any] | None:
    """The encoder's settings from a tokenizer's JSON, or None for a shape it does not reproduce."""
    normalizer = config.get("normalizer") or {}
    model = config.get("model") or {}
    if config.get("truncation") or config.get("padding"):
        return None
    if normalizer.get("type") != "BertNormalizer" or not normalizer.get("clean_text"):
        return None
    if (config.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer":
        return None
    if model.get("type") != "WordPiece" or model.get("unk_token") not in model.get("vocab", {}):
        return None
    added = config.get("added_tokens") or []
    # An added token matched after normalisation could hide in any spelling; not taken.
    if any(token.get("normalized") for token in added):
        return None
    specials = _special_ids(config.get("post_processor"))
    if specials is None:
        return None
    vocab: dict[str, int] = model["vocab"]
    return {
        "vocab": list(vocab.items()),
        "continuing_prefix": model.get("continuing_subword_prefix") or "",
        "unk_id": vocab[model["unk_token"]],
        "max_chars_per_word": int(model.get("max_input_chars_per_word", 100)),
        "lowercase": bool(normalizer.get("lowercase")),
        "prefix_ids": specials[0],
        "suffix_ids": specials[1],
        "added_tokens": [token["content"] for token in added if token.get("content")],
    }


def _special_ids(processor: dict[str, Any] | None) -> tuple[list[int], list[int]] | None:
    """The ids a post-processor puts before and after a single text, or None if it does more."""
    if processor is None:
        return [], []
    if processor.get("type") == "BertProcessing":
        return [int(processor["cls"][1])], [int(processor["sep"][1])]
    if processor.get("type") != "TemplateProcessing":
        return None
    before: list[int] = []
    after: list[int] = []
    seen_text = False
    for piece in processor.get("single", []):
        if "Sequence" in piece:
            if seen_text:
                return None
            seen_text = True
            continue
        special = processor.get("special_tokens", {}).get(piece.get("SpecialToken", {}).get("id"))
        if special is None:
            return None
        (after if seen_text else before).extend(int(i) for i in special["ids"])
    return (before, after) if seen_text else None


def _large_strings(texts: Sequence[str] | pa.Array) -> tuple[np.ndarray, np.ndarray] | None:
    """(int64 offsets, UTF-8 bytes) of the texts, without copying an Arrow array's bytes."""
    import pyarrow as pa

    try:
        array = texts if isinstance(texts, pa.Array) else pa.array(texts, type=pa.large_string())
    except (pa.ArrowException, UnicodeEncodeError):
        return None
    if array.null_count:
        return None
    if len(array) == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.uint8)
    array = array.cast(pa.large_string())
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[
        array.offset : array.offset + len(array) + 1
    ]
    data = (
        np.frombuffer(data_buffer, dtype=np.uint8)
        if data_buffer is not None
        else np.zeros(0, np.uint8)
    )
    return np.ascontiguousarray(offsets), data
